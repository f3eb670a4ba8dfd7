"""Corpus readers: every source becomes a stream of documents, read lazily (memory stays flat).

Sources (repeatable `--corpus`):
  stdlib                  the .py files of the running Python's standard library (offline, built in)
  PATH                    a .txt, .jsonl (a "text" field per line) or .parquet (a "text" column) file,
                          a directory (searched recursively for those) or a glob; .txt and .jsonl may be
                          compressed (.gz, .zst, .bz2, .xz: streamed, never decompressed whole), parquet
                          pages in any codec pyarrow reads
  hf:ORG/NAME[:GLOB]      parquet files of a Hugging Face dataset repo, downloaded with huggingface_hub
                          (e.g. hf:HuggingFaceFW/fineweb-edu:sample/10BT/*.parquet); with HF_HUB_OFFLINE=1
                          it reads the local hub cache only

Invalid text (the documented rule, the same for every format): with utf8_errors="replace" (default)
each invalid UTF-8 byte sequence, and each lone UTF-16 surrogate that a JSON escape can smuggle in
("\ud83d": half an emoji, common in scraped data), becomes U+FFFD, and the number of affected
documents is reported and written to the manifest; with "strict" the first one is an error naming
the file, line and offset. A UTF-8 byte-order mark at the start of a file is dropped; CRLF line
ends are accepted. A missing text (JSONL `"text": null`, a parquet null) is skipped and counted;
a text that is not a string (a number, a list, a binary column) is an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.data.corpus_files import (
    BinaryLines,
    CorpusFile,
    compression,
    hf_files,
    lines_before,
    resolve_files,
)

SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_DOC_MODES = ("auto", "file", "blank-lines")
AUTO_SPLIT_BYTES = (
    64 * 2**20
)  # auto: a .txt larger than this is split at blank lines (no one document is that long)
PIECE_BYTES = 4 * 2**20  # a longer document is read and encoded in pieces of about this size (flat memory)


class Piece(str):
    """Part of a document that the next item continues: no end-of-text after it. Pieces are cut only
    between a line with text and a line that starts with a non-space character (safe_cut): a
    boundary of every pre-tokenisation pattern used here, so a document encodes to the same ids in
    pieces as whole. (After a blank line it is not: GPT-2's pattern splits "\n\nx" as "\n", "\n", "x"
    but a piece ending in "\n\n" as one token.)"""


def safe_cut(previous_line: str, line: str) -> bool:
    return bool(previous_line.strip()) and line[:1] != "" and not line[:1].isspace()


SURROGATE = re.compile("[\ud800-\udfff]")
BOM = "\ufeff"


@dataclass
class Corpus:
    """The documents of one or more sources, in a fixed order, read lazily."""

    specs: list[str]
    txt_docs: str = "auto"  # "file": one document per .txt file; "blank-lines": split on blank lines;
    #                         "auto": file, except for files over AUTO_SPLIT_BYTES (split at blank lines)
    utf8_errors: str = "replace"  # or "strict"
    # "text": documents; "messages": conversations (data/tokenizers/chat_format.py), yielded as canonical JSON
    column: str = "text"
    on_bad: str = "error"  # a malformed conversation: "error" (naming file and line) or "skip" (counted)
    files: list[CorpusFile] = field(init=False)
    bad_documents: int = field(init=False, default=0)  # malformed conversations skipped (on_bad = "skip")
    replaced_documents: int = field(init=False, default=0)  # documents with invalid UTF-8 or lone surrogates
    null_documents: int = field(init=False, default=0)  # JSONL "text": null and parquet nulls, skipped
    auto_split_files: list[str] = field(
        init=False, default_factory=list
    )  # auto: large .txt split at blank lines
    hub: dict[str, dict] = field(
        init=False, default_factory=dict
    )  # hf: spec -> repo, revision, files, offline
    read_documents: dict[str, int] = field(
        init=False, default_factory=dict
    )  # documents per file actually read
    bytes_read: int = field(init=False, default=0)  # file bytes the current pass has consumed (for progress)

    def __post_init__(self):
        if self.txt_docs not in TXT_DOC_MODES:
            raise UserError(f"--txt-docs {self.txt_docs}: use one of {', '.join(TXT_DOC_MODES)}")
        if self.utf8_errors not in ("replace", "strict"):
            raise UserError(f"--utf8-errors {self.utf8_errors}: use replace or strict")
        if not self.specs:
            raise UserError("no --corpus given; e.g. --corpus stdlib")
        if self.on_bad not in ("error", "skip"):
            raise UserError(f"--on-bad {self.on_bad}: use error or skip")
        self.files = []
        for spec in self.specs:
            if spec.startswith("hf:"):
                files, self.hub[spec] = hf_files(spec)
                found = [CorpusFile(p, "parquet", spec) for p in files]
            else:
                found = resolve_files(spec)
            listed = {f.path.resolve() for f in self.files}
            self.files += [
                f for f in found if f.path.resolve() not in listed
            ]  # a file named twice is read once
        for f in self.files:
            if f.kind == "parquet":
                self._check_parquet(f.path)

    @property
    def total_bytes(self) -> int:
        return sum(f.path.stat().st_size for f in self.files)

    def _decode(self, data: bytes, where: str) -> tuple[str, bool]:
        """-> (text, whether anything was replaced); strict: an error naming the place."""
        try:
            return data.decode("utf-8"), False
        except UnicodeDecodeError as e:
            if self.utf8_errors == "strict":
                raise UserError(
                    f"{where}: invalid UTF-8 at byte {e.start}; fix the file or pass --utf8-errors=replace"
                ) from None
            return data.decode("utf-8", errors="replace"), True

    def _no_surrogates(self, text: str, where: str) -> tuple[str, bool]:
        """Lone surrogates cannot be encoded (tokenizers fail on them): U+FFFD, or an error when strict."""
        found = SURROGATE.search(text)
        if found is None:
            return text, False
        if self.utf8_errors == "strict":
            raise UserError(
                f"{where}: lone UTF-16 surrogate {found.group()!r} at character {found.start()} "
                f"(half an emoji?); fix the data or pass --utf8-errors=replace"
            )
        return SURROGATE.sub("\ufffd", text), True

    def _check_parquet(self, path: Path) -> None:
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-parquet bytes
            raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:160]})") from None
        if self.column not in names:
            raise UserError(
                f"{path}: parquet file has no '{self.column}' column (columns: {', '.join(names[:10])})"
            )
        import pyarrow as pa

        column = pq.ParquetFile(path).schema_arrow.field(self.column).type
        if self.column == "messages":
            if not (pa.types.is_list(column) or pa.types.is_large_list(column)):
                raise UserError(f"{path}: the 'messages' column is {column}, not a list of {{role, content}}")
            return
        if not (
            pa.types.is_string(column)
            or pa.types.is_large_string(column)
            or (pa.types.is_dictionary(column) and pa.types.is_string(column.value_type))
        ):
            raise UserError(
                f"{path}: the 'text' column is {column}, not a string; write the documents as strings"
            )

    def documents(self) -> Iterator[str]:
        """Every document, file by file; counts what it read in read_documents and bytes_read (reset
        per pass). bytes_read is in the unit of total_bytes: the readers advance it within a file,
        and it is exact at each file's end (skipped lines, JSON syntax and blank lines included)."""
        self.read_documents, self.bytes_read = {}, 0
        files_done_bytes = 0
        for index, f in enumerate(self.files):
            self.read_documents[str(f.path)] = 0
            for doc in self.read_span(index):
                self.read_documents[str(f.path)] += not isinstance(doc, Piece)
                yield doc
            files_done_bytes += f.path.stat().st_size
            self.bytes_read = files_done_bytes

    def read_span(self, file: int, start: int = 0, end: int = -1) -> Iterator[str]:
        """The documents of files[file], or of part of it (prepare's units, data/work_units.py): for an
        uncompressed JSONL file the lines that start in bytes [start, end), for a parquet file the row
        groups [start, end); end -1: to the end."""
        f = self.files[file]
        if f.kind in ("py", "txt"):
            return self._read_text(f)
        if f.kind == "jsonl":
            return self._read_jsonl(f.path, start, end)
        return self._read_parquet(f.path, start, end)

    def _read_text(self, f: CorpusFile) -> Iterator[str]:
        size = f.path.stat().st_size
        mode = "file" if f.kind == "py" else self.txt_docs
        if mode == "auto":  # a compressed file is taken at ~4x its size
            mode = "blank-lines" if size * (4 if compression(f.path) else 1) > AUTO_SPLIT_BYTES else "file"
            if mode == "blank-lines" and str(f.path) not in self.auto_split_files:
                self.auto_split_files.append(str(f.path))
        if mode == "file" and size <= PIECE_BYTES and not compression(f.path):
            text, replaced = self._decode(f.path.read_bytes(), str(f.path))
            text = text.removeprefix(BOM)
            if text.strip():
                self.replaced_documents += replaced
                yield text
            return
        yield from self._stream_lines(f.path, split_at_blank_lines=mode == "blank-lines")

    def _stream_lines(self, path: Path, split_at_blank_lines: bool) -> Iterator[str]:
        """Stream a text file line by line (a UTF-8 sequence never spans a newline byte): documents end
        at blank lines (or at the end of the file), and a document longer than PIECE_BYTES goes out in
        Pieces (see safe_cut), so memory is bounded by the piece size and the longest line."""
        lines: list[str] = []
        size, replaced_in_document, has_text = 0, False, False
        start = self.bytes_read
        with BinaryLines(path) as fh:
            for lineno, raw in enumerate(fh, 1):
                self.bytes_read = start + fh.position()
                line, replaced = self._decode(raw, f"{path}:{lineno}")
                line = line.removeprefix(BOM) if lineno == 1 else line
                if split_at_blank_lines and not line.strip():
                    if has_text:
                        self.replaced_documents += replaced_in_document
                        yield "".join(lines).rstrip("\r\n")
                    lines, size, replaced_in_document, has_text = [], 0, False, False
                    continue
                if size >= PIECE_BYTES and lines and safe_cut(lines[-1], line):
                    yield Piece("".join(lines))
                    lines, size = [], 0
                lines.append(line)
                size += len(raw)
                replaced_in_document |= replaced
                has_text |= bool(line.strip())
        if has_text:  # the last piece ends the document
            self.replaced_documents += replaced_in_document
            yield "".join(lines).rstrip("\r\n") if split_at_blank_lines else "".join(lines)

    def _read_jsonl(self, path: Path, start: int = 0, end: int = -1) -> Iterator[str]:
        lineno = 0
        try:
            for lineno, raw in self._jsonl_lines(path, start, end):
                text = self._jsonl_record(raw, path, lineno)
                if text is not None:
                    yield text
        except UserError as e:
            if not start:
                raise
            # a range counts its lines from its first; the file's line number is counted only now
            with BinaryLines(path) as fh:
                first = fh.skip_to_line(start)
            absolute = lineno + lines_before(path, first)
            raise UserError(str(e).replace(f"{path}:{lineno}:", f"{path}:{absolute}:", 1)) from None

    def _jsonl_lines(self, path: Path, start: int, end: int) -> Iterator[tuple[int, bytes]]:
        """(line number from the range's start, line) for the lines starting in bytes [start, end)."""
        base = self.bytes_read
        with BinaryLines(path) as fh:
            position = fh.skip_to_line(start)
            for lineno, raw in enumerate(fh, 1):
                if end >= 0 and position >= end:
                    return
                position += len(raw)
                self.bytes_read = base + fh.position()
                yield lineno, (raw.removeprefix(BOM.encode()) if lineno == 1 and not start else raw)

    def _jsonl_record(self, raw: bytes, path: Path, lineno: int) -> str | None:
        """The document of one JSONL line; None for a blank line, a null text or a skipped conversation."""
        if not raw.strip():
            return None
        where = f"{path}:{lineno}"
        line, replaced = self._decode(raw, where)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if self.column == "messages" and self.on_bad == "skip":
                self.bad_documents += 1
                return None
            raise UserError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
            ) from None
        if self.column == "messages":
            conversation = self._conversation(
                record.get("messages") if isinstance(record, dict) else None, where
            )
            if conversation is None:
                return None
            text, smuggled = self._no_surrogates(conversation, where)
            self.replaced_documents += (replaced and "\ufffd" in text) or smuggled
            return text
        if not isinstance(record, dict) or "text" not in record:
            raise UserError(f'{where}: no \'text\' field; each line must be an object like {{"text": "..."}}')
        if record["text"] is None:
            self.null_documents += 1
            return None
        if not isinstance(record["text"], str):
            raise UserError(f"{where}: 'text' must be a string, got {type(record['text']).__name__}")
        text, smuggled = self._no_surrogates(record["text"], where)
        if not text.strip():
            return None
        self.replaced_documents += (
            replaced and "\ufffd" in text
        ) or smuggled  # bad bytes elsewhere don't count
        return text

    def _read_parquet(self, path: Path, first_group: int = 0, end_group: int = -1) -> Iterator[str]:
        """Row groups [first_group, end_group) (-1: to the last), read as bytes and decoded here: parquet
        "strings" can hold invalid UTF-8 too. Rows are numbered from the file's first."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        meta = parquet.metadata
        groups = list(range(first_group, meta.num_row_groups if end_group < 0 else end_group))
        row = sum(meta.row_group(g).num_rows for g in range(first_group))
        start, size, rows = self.bytes_read, path.stat().st_size, max(meta.num_rows, 1)
        for batch in parquet.iter_batches(batch_size=1024, columns=[self.column], row_groups=groups):
            self.bytes_read = start + size * row // rows  # compressed bytes: estimated from the rows read
            column = batch.column(0)
            if self.column == "messages":
                for messages in column.to_pylist():
                    row += 1
                    conversation = self._conversation(messages, f"{path}: row {row}")
                    if conversation is not None:
                        text, smuggled = self._no_surrogates(conversation, f"{path}: row {row}")
                        self.replaced_documents += smuggled
                        yield text
                continue
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            for raw in column.cast(pa.large_binary()).to_pylist():
                row += 1
                if raw is None:
                    self.null_documents += 1
                    continue
                text, replaced = self._decode(raw, f"{path}: row {row}")
                if text.strip():
                    self.replaced_documents += replaced
                    yield text

    def _conversation(self, messages, where: str) -> str | None:
        """A conversation's canonical JSON, or None for a malformed one that on_bad = skip drops (counted)."""
        from pretrainer.data.tokenizers.chat_format import canonical, conversation_problem

        problem = conversation_problem(messages)
        if not problem:
            return canonical(messages)
        if self.on_bad == "skip":
            self.bad_documents += 1
            return None
        raise UserError(
            f"{where}: malformed conversation: {problem}; fix it or pass --on-bad skip to drop such lines"
        )

    def describe(self) -> list[dict]:
        """Provenance per source, for the manifest: the files actually read (a --max-docs run stops
        early) with their size, sha256 and documents read (before exact duplicates are dropped); the
        Python version for stdlib (it defines that corpus); the hub revision and file list for hf:."""
        import platform

        from pretrainer.core.files import sha256_file

        out = []
        for spec in self.specs:
            read = [f for f in self.files if f.source == spec and str(f.path) in self.read_documents]
            entry = {
                "spec": spec,
                "documents": sum(self.read_documents[str(f.path)] for f in read),
                "bytes": sum(f.path.stat().st_size for f in read),
                "files": [
                    {
                        "path": str(f.path),
                        "bytes": f.path.stat().st_size,
                        "sha256": sha256_file(f.path),
                        "documents": self.read_documents[str(f.path)],
                    }
                    for f in read
                ],
            }
            if spec == "stdlib":
                entry["python_version"] = platform.python_version()
            if spec in self.hub:
                entry["hub"] = self.hub[spec]
            out.append(entry)
        return out
