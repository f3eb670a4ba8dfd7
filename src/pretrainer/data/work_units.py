"""prepare's unit of work: the corpus cut into units that workers read and tokenize on their own.

A unit is a run of spans, together about unit_bytes(corpus) of input: whole files (.txt, .py, anything
compressed), byte ranges of an uncompressed JSONL file (a range owns the lines that start in it) and row-group
ranges of a parquet file. The cut depends on the files and their sizes only, never on the number of workers or
parts, so every way of running prepare tokenizes the same units. A worker reads its unit's documents itself,
tokenizes them and writes, under the work dir's units/:

    000012.train.bin, 000012.val.bin        the unit's tokens per split (every document, duplicates too)
    000012.train.mask.bin, ...              --format chat: the loss mask, one byte per token
    000012.docs.npy                         per document: content key, tokens, split, whether it may be
                                            dropped as a duplicate (not a document read in pieces), file
    000012.json                             counts (replaced UTF-8, nulls, bad conversations); written last,
                                            so a unit is complete exactly when it is there

data/shards.py joins the units into the data dir's shards (first occurrence of a document wins)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrainer.core.files import atomic_write_json, naming
from pretrainer.data.encoding import BATCH_CHARS, encode_batch, render_chat_batch
from pretrainer.data.sources import Corpus, Piece
from pretrainer.data.tokenizers.base import Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer

MIN_UNIT_BYTES, MAX_UNIT_BYTES = 4 << 20, 256 << 20
UNITS_PER_CORPUS = 256  # enough units to keep any number of workers busy to the end
DOC_FIELDS = np.dtype([("key", "<u8"), ("tokens", "<u8"), ("val", "?"), ("dedup", "?"), ("file", "<u4")])


def content_key(text: str) -> int:
    """A document's identity for the split and for de-duplication: 64 bits of its blake2b."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_val_document(seed: int, key: int, val_fraction: float) -> bool:
    """The validation split, a function of (seed, content) alone: the same for any worker count or part."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


@dataclass(frozen=True)
class Span:
    """Part of corpus.files[file]: JSONL, bytes [start, end) (the lines starting there); parquet, row groups
    [start, end); end -1: to the end of the file."""

    file: int
    start: int = 0
    end: int = -1


@dataclass(frozen=True)
class WorkUnit:
    index: int
    spans: tuple[Span, ...]
    bytes: int  # of input on disk (progress)


def unit_bytes(total_bytes: int) -> int:
    """Input per unit: a 256th of the corpus, between 4 MiB (small corpora still split in many) and 256 MiB
    (a 100B-token corpus in ~1,600 units)."""
    return min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total_bytes // UNITS_PER_CORPUS))


def _segments(index: int, corpus: Corpus) -> tuple[list[tuple[Span, int]], bool]:
    """A file's pieces with their sizes on disk: its row groups, or the whole file; and whether that whole
    file may be cut at any byte (an uncompressed JSONL file: a range owns the lines that start in it). A
    compressed file is read from its start, so it is never cut."""
    from pretrainer.data.corpus_files import compression

    f = corpus.files[index]
    size = f.path.stat().st_size
    if f.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(f.path).metadata
        sizes = [
            sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
            for g in range(meta.num_row_groups)
        ]
        if not sizes:
            return [(Span(index), size)], False
        sizes[0] += size - sum(sizes)  # the header and footer: units sum to the files' sizes (progress)
        return [(Span(index, g, g + 1), n) for g, n in enumerate(sizes)], False
    return [(Span(index), size)], f.kind == "jsonl" and not compression(f.path)


def plan_units(corpus: Corpus) -> list[WorkUnit]:
    """The corpus's units, in corpus order (see the module docstring)."""
    target = unit_bytes(corpus.total_bytes)
    units: list[WorkUnit] = []
    spans: list[Span] = []
    filled = 0

    def add(span: Span, size: int) -> None:
        nonlocal filled
        last = spans[-1] if spans else None
        if last is not None and last.file == span.file and last.end == span.start and last.end != -1:
            spans[-1] = Span(span.file, last.start, span.end)  # row groups in a row: one span
        else:
            spans.append(span)
        filled += size
        if filled >= target:
            units.append(WorkUnit(len(units), tuple(spans), filled))
            spans.clear()
            filled = 0

    for index in range(len(corpus.files)):
        segments, divisible = _segments(index, corpus)
        size = segments[0][1]
        if divisible and size > target - filled:  # byte ranges, the first filling what is left of the unit
            start = 0
            while size - start > target - filled:
                end = start + target - filled
                add(Span(index, start, end), end - start)
                start = end
            if start < size:
                add(Span(index, start, -1), size - start)
            continue
        for span, piece in segments:
            add(span, piece)
    if spans:
        units.append(WorkUnit(len(units), tuple(spans), filled))
    return units


def unique_suffix() -> str:
    """A temp name's suffix no other process uses, on this host or another one sharing the filesystem."""
    import socket
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def unit_path(units_dir: Path, index: int, suffix: str) -> Path:
    return units_dir / f"{index:06d}.{suffix}"


def unit_record(units_dir: Path, index: int) -> dict | None:
    """A complete unit's record (its .json, written last), or None."""
    import json

    path = unit_path(units_dir, index, "json")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for name, size in record["files"].items():  # a unit whose files were changed since: done again
        file = units_dir / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return record


@dataclass
class UnitSettings:
    """What every unit is tokenized with (a worker gets it once)."""

    corpus: Corpus
    tokenizer_dir: Path
    units_dir: Path
    seed: int
    val_fraction: float
    chat: bool
    dtype: str


_worker: dict = {}  # a worker process's settings and tokenizer (init_worker)


def init_worker(settings: UnitSettings, parent: int) -> None:
    """A worker's start: its settings, its tokenizer, and the watch on `parent` (the prepare's pid, given,
    not read here: a parent killed while this process started has been replaced already)."""
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # an hf: tokenizer's own threads: one process per core
    _worker.update(settings=settings, tokenizer=load_tokenizer(settings.tokenizer_dir))


def _exit_with(parent: int) -> None:
    """A worker ends within a second of its prepare (killed with -9, its queue never closes): an orphan
    would wait forever. A unit it was writing stays under temp names, never a record."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


class _UnitFile:
    """One split's tokens (and mask) of a unit, written under a temporary name, renamed by finish()."""

    def __init__(self, path: Path, dtype: np.dtype, chat: bool):
        self.path, self.dtype = path, dtype
        self.paths = [path] + ([path.with_suffix(".mask.bin")] if chat else [])
        # this process's own temp names (host, pid, random: parts on several nodes share the work dir): two
        # processes on one unit (the same part run twice) write the same bytes, and each renames only its own
        self.files = [open(p.with_name(f".{p.name}.tmp-{unique_suffix()}"), "wb") for p in self.paths]
        self.tokens = self.trained = 0

    def write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        try:
            self.files[0].write(tokens.astype(self.dtype).tobytes())
            if mask is not None:
                self.files[1].write(mask.astype(np.uint8).tobytes())
                self.trained += int(mask.sum())
        except OSError as e:  # a full disk: say which file
            raise naming(e, self.path) from None
        self.tokens += len(tokens)

    def finish(self) -> dict[str, int]:
        sizes = {}
        for f, path in zip(self.files, self.paths):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(f.name, path)
            sizes[path.name] = path.stat().st_size
        return sizes


def tokenize_unit(
    unit: WorkUnit, settings: UnitSettings | None = None, tokenizer: Tokenizer | None = None
) -> dict:
    """Read, tokenize and write one unit (in a worker: the settings and tokenizer init_worker loaded).
    -> its record, also written to its .json."""
    settings = settings or _worker["settings"]
    tokenizer = tokenizer or _worker["tokenizer"]
    corpus, units_dir, dtype = settings.corpus, settings.units_dir, np.dtype(settings.dtype)
    corpus.replaced_documents = corpus.null_documents = corpus.bad_documents = 0
    corpus.auto_split_files = []
    writers = {
        s: _UnitFile(unit_path(units_dir, unit.index, f"{s}.bin"), dtype, settings.chat)
        for s in ("train", "val")
    }
    encode = render_chat_batch if settings.chat else encode_batch
    docs: list[tuple] = []
    current = None  # [key, tokens, val, dedup, file] of the document being read (in pieces)
    texts: list[str] = []
    files: list[int] = []
    chars = 0
    max_token = 0

    def flush() -> None:
        nonlocal current, chars, max_token
        starts = [current is None] + [not isinstance(t, Piece) for t in texts[:-1]]
        flat, mask, lengths = encode(texts, starts, tokenizer)
        if len(flat):
            max_token = max(max_token, int(flat.max()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        splits = []
        for text, file, length in zip(texts, files, lengths.tolist()):
            if current is None:
                key = content_key(text)
                current = [
                    key,
                    0,
                    is_val_document(settings.seed, key, settings.val_fraction),
                    not isinstance(text, Piece),
                    file,
                ]
            current[1] += length
            splits.append("val" if current[2] else "train")
            if not isinstance(text, Piece):
                docs.append(tuple(current))
                current = None
        first = 0
        for last in range(len(texts)):  # one write per run of items bound for the same split
            if last + 1 == len(texts) or splits[last + 1] != splits[first]:
                span = slice(offsets[first], offsets[last + 1])
                writers[splits[first]].write(flat[span], None if mask is None else mask[span])
                first = last + 1
        texts.clear()
        files.clear()
        chars = 0

    for span in unit.spans:
        for text in corpus.read_span(span.file, span.start, span.end):
            texts.append(text)
            files.append(span.file)
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
    if texts:
        flush()
    sizes = {}
    for writer in writers.values():
        sizes.update(writer.finish())
    table = np.array(docs, dtype=DOC_FIELDS)
    docs_path = unit_path(units_dir, unit.index, "docs.npy")
    staging = docs_path.with_name(f".{docs_path.name}.tmp-{unique_suffix()}")
    try:
        with open(staging, "wb") as f:
            np.save(f, table)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, docs_path)
    except BaseException:  # a stop signal or a full disk mid-write: no temp file left in the units
        staging.unlink(missing_ok=True)
        raise
    sizes[docs_path.name] = docs_path.stat().st_size
    record = {
        "unit": unit.index,
        "documents": len(table),
        "tokens": {s: w.tokens for s, w in writers.items()},
        "max_token": max_token,
        "replaced_documents": corpus.replaced_documents,
        "null_documents": corpus.null_documents,
        "bad_documents": corpus.bad_documents,
        "auto_split_files": corpus.auto_split_files,
        "files": sizes,
    }
    atomic_write_json(unit_path(units_dir, unit.index, "json"), record)
    return record
