"""OUT written from the work dir's units: the tokenizer's files, the shards (data/shards.py joins the units
in corpus order as each is ready, while the rest are tokenized), the manifest, and one line for each kind of
document replaced, skipped or dropped on the way. data/prepare.py decides what to tokenize and with what."""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pretrainer import __version__
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_json
from pretrainer.data.shards import Assembly
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.base import Tokenizer
from pretrainer.data.work_dir import Work
from pretrainer.data.work_units import WorkUnit


def join_units(
    work: Work,
    tmp: Path,
    *,
    workers: int,
    max_docs: int,
    shard_tokens: int,
    command: str,
    tokenizer_from: str,
    out: Path,
) -> dict:
    """Tokenize what is missing and join every unit, as each is ready, into `tmp`'s shards; write the
    tokenizer and the manifest there. -> the manifest."""
    corpus, tokenizer = work.corpus, work.tokenizer
    for name in tokenizer.files:  # as saved into the work dir (saving again costs seconds for GPT-2's files)
        shutil.copyfile(work.path / "tokenizer" / name, tmp / name)
    assembly = Assembly(
        tmp, work.path / "units", work.dtype, chat=work.chat, shard_tokens=shard_tokens, max_docs=max_docs
    )
    used = work.run(workers, use=assembly.add, stop_early=bool(max_docs))
    splits = assembly.close()
    counts = {
        name: sum(record[name] for record in used)
        for name in ("replaced_documents", "null_documents", "bad_documents")
    }
    auto_split = list(dict.fromkeys(path for record in used for path in record["auto_split_files"]))
    # the files read: those of the units used, up to the last document's when --max-docs stopped early
    last = max(assembly.read_documents, default=-1) if assembly.full else len(corpus.files)
    read = sorted({i for record in used for i in files_of(work.units[record["unit"]]) if i <= last})
    corpus.read_documents = {str(corpus.files[i].path): assembly.read_documents.get(i, 0) for i in read}
    documents = splits["train"]["documents"] + splits["val"]["documents"]
    for name, split in splits.items():
        if split["documents"] == 0:
            raise UserError(
                f"{out}: the {name} split is empty "
                f"({documents} documents, --val-fraction {work.settings.val_fraction}); "
                f"use a larger corpus or a {'larger' if name == 'val' else 'smaller'} --val-fraction"
            )
    report_counts(corpus, counts, assembly.duplicates, auto_split)
    manifest = manifest_of(
        corpus,
        tokenizer,
        command=command,
        tokenizer_from=tokenizer_from,
        dtype=work.dtype,
        assembly=assembly,
        seed=work.settings.seed,
        val_fraction=work.settings.val_fraction,
        shard_tokens=shard_tokens,
        counts=counts,
        auto_split=auto_split,
        splits=splits,
        chat=work.chat,
    )
    atomic_write_json(tmp / "manifest.json", manifest)
    return manifest


def manifest_of(
    corpus: Corpus,
    tokenizer: Tokenizer,
    *,
    command: str,
    tokenizer_from: str,
    dtype: np.dtype,
    assembly: Assembly,
    seed: int,
    val_fraction: float,
    shard_tokens: int,
    counts: dict,
    auto_split: list[str],
    splits: dict,
    chat: bool,
) -> dict:
    """manifest.json: what was read (files, hashes, counts), how (tokenizer, split rule, command) and what
    was written (each split's shards and checksums)."""
    manifest = {
        "format": "pretrainer-tokens-v2",
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
        "max_token_id": assembly.max_token,
        "seed": seed,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "utf8": {"errors": corpus.utf8_errors, "replaced_documents": counts["replaced_documents"]},
        "null_documents": counts["null_documents"],
        "duplicate_documents": assembly.duplicates,
        "split_by": "content hash (exact duplicates dropped)",
        "auto_split_files": auto_split,
        "splits": splits,
    }
    if chat:
        from pretrainer.data.tokenizers.chat_format import TEMPLATE

        manifest["chat"] = {
            "template": TEMPLATE,
            "loss_mask": "1 on assistant content and <|assistant_end|>",
            "bad_conversations": counts["bad_documents"],
            "on_bad": corpus.on_bad,
        }
    return manifest


def files_of(unit: WorkUnit) -> list[int]:
    return list(dict.fromkeys(span.file for span in unit.spans))


def report_counts(corpus: Corpus, counts: dict, duplicates: int, auto_split: list[str]) -> None:
    """One line each for what was replaced, skipped or dropped on the way."""
    if counts["replaced_documents"]:
        print(
            f"warning: {counts['replaced_documents']} documents had invalid UTF-8 or lone surrogates, "
            f"replaced with U+FFFD (pass --utf8-errors=strict to reject them)",
            flush=True,
        )
    if counts["null_documents"]:
        print(f"note: {counts['null_documents']} documents had no text (null) and were skipped", flush=True)
    if counts["bad_documents"]:
        print(
            f"note: {counts['bad_documents']} malformed conversations were skipped (--on-bad skip)",
            flush=True,
        )
    if duplicates:
        print(f"note: {duplicates} exact duplicate documents were dropped", flush=True)
    for spec, hub in corpus.hub.items():
        if hub["offline"]:
            print(
                f"warning: {spec}: offline (HF_HUB_OFFLINE): used the {len(hub['files'])} cached files "
                f"of {hub['repo']}@{hub['revision'][:12]}; "
                f"files the hub has beyond this cache were not seen",
                flush=True,
            )
    for path in auto_split:
        print(
            f"note: {path} is over 64 MiB: split into documents at blank lines "
            f"(--txt-docs=file keeps it whole)",
            flush=True,
        )
