"""Documents -> token files + manifest.

    OUT/
      train.bin, val.bin    flat token ids (uint16 when vocab <= 65536, else uint32); every document
                            is followed by the end-of-text token, so boundaries are real documents
                            (and, for an hf: tokenizer whose post-processor starts a sequence with a
                            BOS such as Llama-3's, preceded by that BOS: data/tokenizers/hf.py)
      pretrainer-tokenizer.json, tokenizer.tiktoken
                            the tokenizer (see data/tokenizers/bpe.py)
      tokenizer.json, tokenizer_config.json
                            the same tokenizer for Hugging Face (AutoTokenizer.from_pretrained(OUT));
                            for --tokenizer hf:...: its tokenizer.json, byte for byte, and our metadata
      manifest.json         tokenizer id/hash, dtype, per-split document and token counts, sha256 of
                            each file, sources, the command and the pretrainer version
      train.mask.bin,       --format chat only: one byte per token, 1 where the token is trained on
      val.mask.bin          (assistant content and its end token; data/tokenizers/chat_format.py); the
                            manifest records the template, the special tokens and the trained-token counts

The validation split is by document content: a document goes to val when a hash of (seed, its
content hash) falls below val_fraction, so the split is deterministic, independent of worker
count, needs no shuffle buffer, and an exact duplicate could never land in the other split; exact
duplicates are dropped anyway (counted in the manifest; the set of content hashes costs 8-16 bytes
per document). A document streamed in pieces (see sources.Piece) is keyed by its first piece and
not deduplicated. A trained BPE learns from the train split only. Everything is written to a temp
directory beside OUT and renamed only when complete.
Memory stays flat: documents stream from the sources, at most 2 x workers batches are in flight.
Workers are spawned processes: a script that calls prepare() with workers > 1 needs the usual
`if __name__ == "__main__":` guard (the CLI has it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pretrainer import __version__
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_directory, atomic_write_json
from pretrainer.core.ownership import check_replaceable
from pretrainer.data.encoding import (
    SplitWriter,
    document_batches,
    encode_batch,
    encode_stream,
    first_chars,
    render_chat_batch,
)
from pretrainer.data.sources import Corpus, Piece
from pretrainer.data.tokenizers.base import METADATA_FILE, RANKS_FILE, Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer, tokenizer_from_spec

BPE_TRAIN_CHARS = 2_000_000_000  # a trained BPE sees at most this much text (enough for its statistics)


def tokenizer_of(path: str) -> Tokenizer:
    """The tokenizer of a run dir (RUN/tokenizer), a checkpoint (its run's) or a prepared data dir."""
    path = Path(path)
    for candidate in (path / "tokenizer", path.parent.parent / "tokenizer", path):
        if (candidate / METADATA_FILE).is_file() or (candidate / RANKS_FILE).is_file():
            return load_tokenizer(candidate)
    raise UserError(
        f"--tokenizer-from {path}: no tokenizer there; give a run dir, a checkpoint or a prepared data dir"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def content_key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_val_document(seed: int, key: int, val_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


class KeySet:
    """A set of 64-bit content keys in one numpy array (open addressing, at most half full): 8-16
    bytes per document, where a Python set of ints takes ~70."""

    def __init__(self, capacity: int = 1 << 16):
        self.slots, self.used, self.has_zero = np.zeros(capacity, dtype=np.uint64), 0, False

    def add(self, key: int) -> bool:
        """Insert; False when the key was already there."""
        if key == 0:  # 0 marks an empty slot, so the key 0 is kept aside
            new, self.has_zero = not self.has_zero, True
            return new
        key = np.uint64(key)
        mask = len(self.slots) - 1
        i = int(key) & mask
        while self.slots[i]:
            if self.slots[i] == key:
                return False
            i = (i + 1) & mask
        self.slots[i] = key
        self.used += 1
        if 2 * self.used > len(self.slots):
            old, self.slots, self.used = (
                self.slots[self.slots != 0],
                np.zeros(2 * len(self.slots), dtype=np.uint64),
                0,
            )
            for k in old.tolist():
                self.add(k)
        return True


class KeyedDocuments:
    """(text, content key) for each item of a document stream, exact duplicates of whole documents
    dropped (and counted), stopping after max_docs documents (0: all)."""

    def __init__(self, docs: Iterator[str], max_docs: int = 0):
        self.docs, self.max_docs = docs, max_docs
        self.duplicates, self.documents = 0, 0

    def __iter__(self) -> Iterator[tuple[str, int]]:
        seen = KeySet()
        key = None  # of the document whose pieces are being streamed
        for text in self.docs:
            if key is None:
                key = content_key(text)
                if not isinstance(text, Piece) and not seen.add(key):
                    self.duplicates += 1
                    key = None
                    continue
            yield text, key
            if not isinstance(text, Piece):
                self.documents += 1
                key = None
                if self.max_docs and self.documents >= self.max_docs:
                    return  # before reading another document from the sources


def prepare(
    corpus: Corpus,
    tokenizer_spec: str,
    out: Path,
    *,
    val_fraction: float = 0.005,
    seed: int = 0,
    workers: int = 0,
    max_docs: int = 0,
    force: bool = False,
    command: str = "",
    fmt: str = "text",
    tokenizer_from: str = "",
    eot_token: str = "",
) -> dict:
    """Tokenize `corpus` into OUT (see the module docstring). fmt "chat": the corpus holds conversations
    (Corpus(column="messages")), written in the chat template with a loss mask
    (data/tokenizers/chat_format.py);
    tokenizer_from: reuse the tokenizer of a run, checkpoint or data dir exactly (chat: plus the chat tokens);
    eot_token: the document separator of an hf: tokenizer (default: found among its special tokens)."""
    out = Path(out)
    chat = fmt == "chat"
    if fmt not in ("text", "chat"):
        raise UserError(f"--format {fmt}: use text or chat")
    if chat and corpus.column != "messages":
        raise UserError(
            "--format chat reads conversations: the corpus must be read with Corpus(column='messages')"
        )
    if chat and any(f.kind not in ("jsonl", "parquet") for f in corpus.files):
        bad = next(f for f in corpus.files if f.kind not in ("jsonl", "parquet"))
        raise UserError(
            f'{bad.path}: --format chat reads .jsonl (a "messages" list per line) '
            f"or .parquet (a messages column)"
        )
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: must be between 0 and 1 (exclusive)")
    if out.exists() and not force:
        raise UserError(
            f"{out}: output directory already exists; choose another --out or pass --force to replace it"
        )
    inputs = [f.path for f in corpus.files] + ([tokenizer_from] if tokenizer_from else [])
    check_replaceable(out, "data", keep=inputs)
    workers = workers or min(os.cpu_count() or 1, 8)
    if eot_token and (tokenizer_from or not tokenizer_spec.startswith("hf:")):
        raise UserError(
            f"--eot-token {eot_token}: only with --tokenizer hf:DIR_OR_REPO (gpt2, bpe:N and "
            f"--tokenizer-from keep their own end-of-text)"
        )
    hf_tokenizer = None
    if (
        tokenizer_spec.startswith("hf:") and not tokenizer_from
    ):  # a bad tokenizer.json fails before the corpus is read
        hf_tokenizer = tokenizer_from_spec(tokenizer_spec, eot_token=eot_token)

    def documents() -> KeyedDocuments:
        return KeyedDocuments(corpus.documents(), max_docs)

    first = next(iter(documents()), None)
    if first is None:
        raise UserError(f"{', '.join(corpus.specs)}: empty corpus (no non-blank documents)")

    # renamed to `out` only when complete (--force: the old one goes only then)
    with atomic_directory(out, kind="data", replace=force) as tmp:
        started = time.time()
        if tokenizer_from:
            tokenizer = tokenizer_of(tokenizer_from)
        elif hf_tokenizer is not None:
            tokenizer = hf_tokenizer
        elif tokenizer_spec.startswith("bpe:"):
            print(f"training {tokenizer_spec} on the train split ...", flush=True)
            train_texts = (text for text, key in documents() if not is_val_document(seed, key, val_fraction))
            if chat:  # the BPE learns from what the messages say, not from their JSON
                train_texts = ("\n".join(m["content"] for m in json.loads(t)) for t in train_texts)
            tokenizer = tokenizer_from_spec(tokenizer_spec, first_chars(train_texts, BPE_TRAIN_CHARS))
        else:
            tokenizer = tokenizer_from_spec(tokenizer_spec)
        if chat:
            from pretrainer.data.tokenizers.chat_format import chat_tokenizer

            tokenizer = chat_tokenizer(tokenizer)
        tokenizer.save(tmp)
        dtype = token_dtype(tokenizer.vocab_size)

        corpus.replaced_documents = corpus.null_documents = corpus.bad_documents = (
            0  # count once, on the encoding pass
        )
        writers = {
            "train": SplitWriter(tmp / "train.bin", dtype, chat),
            "val": SplitWriter(tmp / "val.bin", dtype, chat),
        }
        # Progress in file bytes read (corpus.bytes_read), the unit of total_bytes; a --max-docs run has no
        # known end.
        progress = tqdm(
            total=None if max_docs else corpus.total_bytes,
            unit="B",
            unit_scale=True,
            desc="tokenizing",
            mininterval=1.0,
            dynamic_ncols=True,
        )
        doc_index, max_token = 0, 0
        keyed = documents()
        encode = render_chat_batch if chat else encode_batch
        for (flat, mask, lengths), keys, ends in encode_stream(
            document_batches(iter(keyed)), tokenizer, tmp, workers, encode
        ):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            splits = ["val" if is_val_document(seed, key, val_fraction) else "train" for key in keys]
            first = 0
            for last in range(len(keys)):  # one write per run of consecutive items bound for the same split
                if last + 1 == len(keys) or splits[last + 1] != splits[first]:
                    span = slice(offsets[first], offsets[last + 1])
                    writers[splits[first]].write(
                        flat[span], sum(ends[first : last + 1]), None if mask is None else mask[span]
                    )
                    first = last + 1
            doc_index += sum(ends)
            max_token = max(max_token, int(flat.max()))
            progress.update(corpus.bytes_read - progress.n)
            n_tokens = writers["train"].tokens + writers["val"].tokens
            progress.set_postfix_str(
                f"{n_tokens / max(time.time() - started, 1e-9):,.0f} tok/s, {doc_index:,} docs", refresh=False
            )
        progress.update(corpus.bytes_read - progress.n)  # what the reader consumed after the last batch left
        progress.close()
        splits = {name: writer.close() for name, writer in writers.items()}
        for name, split in splits.items():
            if split["documents"] == 0:
                raise UserError(
                    f"{out}: the {name} split is empty "
                    f"({doc_index} documents, --val-fraction {val_fraction}); "
                    f"use a larger corpus or a {'larger' if name == 'val' else 'smaller'} --val-fraction"
                )
        if corpus.replaced_documents:
            print(
                f"warning: {corpus.replaced_documents} documents had invalid UTF-8 or lone surrogates, "
                f"replaced with U+FFFD (pass --utf8-errors=strict to reject them)",
                flush=True,
            )
        if corpus.null_documents:
            print(f"note: {corpus.null_documents} documents had no text (null) and were skipped", flush=True)
        if corpus.bad_documents:
            print(
                f"note: {corpus.bad_documents} malformed conversations were skipped (--on-bad skip)",
                flush=True,
            )
        if keyed.duplicates:
            print(f"note: {keyed.duplicates} exact duplicate documents were dropped", flush=True)
        for spec, hub in corpus.hub.items():
            if hub["offline"]:
                print(
                    f"warning: {spec}: offline (HF_HUB_OFFLINE): used the {len(hub['files'])} cached files "
                    f"of {hub['repo']}@{hub['revision'][:12]}; "
                    f"files the hub has beyond this cache were not seen",
                    flush=True,
                )
        for path in corpus.auto_split_files:
            print(
                f"note: {path} is over 64 MiB: split into documents at blank lines "
                f"(--txt-docs=file keeps it whole)",
                flush=True,
            )

        manifest = {
            "format": "pretrainer-tokens-v1",
            "pretrainer_version": __version__,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "sources": corpus.describe(),
            "content": "chat" if chat else "text",
            "tokenizer": {
                "name": tokenizer.name,
                "sha256": tokenizer.sha256,
                "vocab_size": tokenizer.vocab_size,
                "eot_id": tokenizer.eot_id,
                "special_tokens": tokenizer.special_tokens,
                **(
                    {
                        "eot_token": tokenizer.eot_name,
                        "bos_token": tokenizer.bos_name,
                        "bos_id": tokenizer.bos_id,
                        "file_sha256": tokenizer.file_sha256,
                    }
                    if tokenizer.kind == "hf"
                    else {}
                ),
                "files": list(tokenizer.files),
                **({"from": tokenizer_from} if tokenizer_from else {}),
            },
            "dtype": dtype.name,
            "max_token_id": max_token,
            "seed": seed,
            "val_fraction": val_fraction,
            "utf8": {"errors": corpus.utf8_errors, "replaced_documents": corpus.replaced_documents},
            "null_documents": corpus.null_documents,
            "duplicate_documents": keyed.duplicates,
            "split_by": "content hash (exact duplicates dropped)",
            "auto_split_files": corpus.auto_split_files,
            "splits": splits,
        }
        if chat:
            from pretrainer.data.tokenizers.chat_format import TEMPLATE

            manifest["chat"] = {
                "template": TEMPLATE,
                "loss_mask": "1 on assistant content and <|assistant_end|>",
                "bad_conversations": corpus.bad_documents,
                "on_bad": corpus.on_bad,
            }
        atomic_write_json(tmp / "manifest.json", manifest)
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    print(
        f"wrote {out}: {doc_index:,} documents, {total:,} tokens ({splits['train']['tokens']:,} train, "
        f"{splits['val']['tokens']:,} val) in {time.time() - started:.1f}s"
    )
    return manifest
