"""Documents -> token files + manifest.

    OUT/
      train-00000.bin, ...  flat token ids in shards of --shard-tokens (uint16 when vocab <= 65536, else
      val-00000.bin, ...    uint32); every document is followed by the end-of-text token, so boundaries are
                            real documents (and, for an hf: tokenizer whose post-processor starts a
                            sequence with a BOS such as Llama-3's, preceded by that BOS:
                            data/tokenizers/hf.py); a split's shards are one stream cut at token counts
                            (data/token_files.py reads them as one; a data dir from before shards has one
                            train.bin and val.bin, read the same way)
      pretrainer-tokenizer.json, tokenizer.tiktoken
                            the tokenizer (see data/tokenizers/bpe.py)
      tokenizer.json, tokenizer_config.json
                            the same tokenizer for Hugging Face (AutoTokenizer.from_pretrained(OUT));
                            for --tokenizer hf:...: its tokenizer.json, byte for byte, and our metadata
      manifest.json         tokenizer id/hash, dtype, per-split document and token counts, each shard
                            with its sha256 (whole and per chunk), the sha256 of each split's stream,
                            sources, the command and the pretrainer version
      train-00000.mask.bin, --format chat only: one byte per token, 1 where the token is trained on
      ...                   (assistant content and its end token; data/tokenizers/chat_format.py); the
                            manifest records the template, the special tokens and the trained-token counts

How: the corpus is cut into units (data/work_units.py: whole files, byte ranges of JSONL, row groups of
parquet), which worker processes read, tokenize and write on their own into OUT.prepare/, the work dir
(data/work_dir.py); the main process assigns units and joins the finished ones, in corpus order, into OUT's
shards (data/join.py, data/shards.py).

The validation split is by document content: a document goes to val when a hash of (seed, its
content hash) falls below val_fraction, so the split is deterministic, independent of worker
count, needs no shuffle buffer, and an exact duplicate could never land in the other split; exact
duplicates are dropped anyway, the first occurrence kept (counted in the manifest; the set of content
hashes costs 8-16 bytes per document). A document streamed in pieces (see sources.Piece) is keyed by its
first piece and not deduplicated. So the same corpus, tokenizer and seed give byte-identical files for any
number of workers, and for --part 1/N .. N/N followed by --merge.

Resumable: a unit's files are complete once its record is written, so a prepare killed at any point and
run again with the same command keeps the units done and tokenizes the rest; the work dir records the
command (command.json), and a different one is refused in one line (--force starts over). OUT itself is
written to a temp directory beside it and renamed only when complete; the work dir goes after that.
A trained BPE learns from the train split only (and is trained once: the work dir keeps it).
Workers are spawned processes: a script that calls prepare() with workers > 1 needs the usual
`if __name__ == "__main__":` guard (the CLI has it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_directory
from pretrainer.core.hardware import usable_cores
from pretrainer.core.ownership import check_replaceable
from pretrainer.data.encoding import first_chars
from pretrainer.data.join import join_units
from pretrainer.data.shards import SHARD_TOKENS, KeySet
from pretrainer.data.sources import Corpus, Piece
from pretrainer.data.tokenizers.base import METADATA_FILE, RANKS_FILE, Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer, tokenizer_from_spec
from pretrainer.data.work_dir import (
    Work,
    command_fingerprint,
    discard_work_dir,
    open_work_dir,
    work_dir_of,
    work_tokenizer,
)
from pretrainer.data.work_units import content_key, is_val_document

__all__ = ["KeyedDocuments", "content_key", "is_val_document", "prepare", "tokenizer_of"]

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


class KeyedDocuments:
    """(text, content key) for each item of a document stream, exact duplicates of whole documents
    dropped (and counted), stopping after max_docs documents (0: all): the documents a trained BPE learns
    from, in the order and with the rule the units' assembly keeps them (data/shards.py)."""

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


def parse_part(part: str) -> tuple[int, int]:
    """--part I/N -> (I, N); "" -> (0, 0)."""
    if not part:
        return 0, 0
    try:
        index, count = (int(x) for x in part.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise UserError(
            f"--part {part}: give I/N with 1 <= I <= N, e.g. --part 2/8 (a SLURM array task per part)"
        )
    return index, count


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
    shard_tokens: int = SHARD_TOKENS,
    part: str = "",
    merge: bool = False,
) -> dict | None:
    """Tokenize `corpus` into OUT (see the module docstring). fmt "chat": the corpus holds conversations
    (Corpus(column="messages")), written in the chat template with a loss mask
    (data/tokenizers/chat_format.py);
    tokenizer_from: reuse the tokenizer of a run, checkpoint or data dir exactly (chat: plus the chat tokens);
    eot_token: the document separator of an hf: tokenizer (default: found among its special tokens);
    part "I/N": tokenize only the I-th of N slices of the units into the work dir (no OUT yet); merge: join
    the work dir's units, every part done, into OUT. -> the manifest (None for a part)."""
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
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens}: must be at least 1")
    part_index, parts = parse_part(part)
    if part and merge:
        raise UserError("prepare: --part tokenizes one slice, --merge joins them all; give one of the two")
    if out.exists() and not force:
        raise UserError(
            f"{out}: output directory already exists; choose another --out or pass --force to replace it"
        )
    inputs = [f.path for f in corpus.files] + ([tokenizer_from] if tokenizer_from else [])
    check_replaceable(out, "data", keep=inputs)
    workers = workers or usable_cores()
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

    if next(iter(documents()), None) is None:
        raise UserError(f"{', '.join(corpus.specs)}: empty corpus (no non-blank documents)")

    started = time.time()
    work_path = work_dir_of(out)
    check_replaceable(work_path, "prepare-work", keep=inputs)
    fingerprint = command_fingerprint(
        corpus,
        tokenizer=tokenizer_spec,
        tokenizer_from=str(Path(tokenizer_from).resolve()) if tokenizer_from else "",
        eot_token=eot_token,
        format=fmt,
        val_fraction=val_fraction,
        seed=seed,
        max_docs=max_docs,
        shard_tokens=shard_tokens,
    )

    def make_tokenizer() -> Tokenizer:
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
        return tokenizer

    created = False  # whether this call made the work dir (only then may a failure remove it)

    def open_work() -> Work:
        nonlocal created
        created = open_work_dir(work_path, fingerprint, force=force, part=bool(parts))
        tokenizer = work_tokenizer(work_path, make_tokenizer)
        work = Work(
            work_path,
            corpus,
            tokenizer,
            part_index=part_index,
            parts=parts,
            seed=seed,
            val_fraction=val_fraction,
            chat=chat,
        )
        if work.done:
            print(
                f"{work_path}: kept {len(work.done)} of {len(work.mine)} units tokenized before"
                + ("; tokenizing the rest" if len(work.done) < len(work.mine) else ""),
                flush=True,
            )
        return work

    if parts:  # parts share the work dir (disjoint units); only the joining job writes OUT
        work = open_work()
        work.run(workers)
        print(
            f"part {part}: {len(work.mine)} units tokenized into {work_path} in "
            f"{time.time() - started:.1f}s; once every part is done, join them: the same command with "
            f"--merge instead of --part"
        )
        return None

    if merge and not work_path.is_dir():
        raise UserError(f"{work_path}: not found; run every --part I/N of this command first, then --merge")
    # renamed to `out` only when complete; while it is written, no other prepare into `out` starts
    with atomic_directory(out, kind="data", replace=force) as tmp:
        try:
            work = open_work()
            if merge and len(work.done) < len(work.units):
                raise UserError(
                    f"{work_path}: {len(work.units) - len(work.done)} of {len(work.units)} units are not "
                    f"tokenized yet; run every --part I/N first (or this command without --merge: it "
                    f"tokenizes what is missing)"
                )
            manifest = join_units(
                work,
                tmp,
                workers=workers,
                max_docs=max_docs,
                shard_tokens=shard_tokens,
                command=command,
                tokenizer_from=tokenizer_from,
                out=out,
            )
        except BaseException:
            if created and not any((work_path / "units").glob("*.json")):  # nothing worth keeping: no trace
                discard_work_dir(work_path)
            raise
    discard_work_dir(work_path)  # OUT is complete: the units are no longer needed
    splits = manifest["splits"]
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    shards = len(splits["train"]["shards"]) + len(splits["val"]["shards"])
    print(
        f"wrote {out}: {splits['train']['documents'] + splits['val']['documents']:,} documents, {total:,} "
        f"tokens ({splits['train']['tokens']:,} train, {splits['val']['tokens']:,} val) in {shards} shards, "
        f"in {time.time() - started:.1f}s"
    )
    return manifest
