"""A corpus spec's files: local files, dirs and globs, hf:ORG/NAME[:GLOB] (from the local Hugging Face cache
or a download), the built-in stdlib corpus; each file's kind and compression, and the compressed streams
(gzip, zstandard frames, bz2, xz) read line by line with their byte position (data/sources.py reads
documents from them)."""

from __future__ import annotations

import bz2
import fnmatch
import gzip
import io
import lzma
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrainer.core.errors import UserError


@dataclass
class CorpusFile:
    path: Path
    kind: str  # "py" (stdlib), "txt", "jsonl" or "parquet"
    source: str  # the --corpus spec it came from


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    return sorted(files)


COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")  # streamed by gzip, zstandard, bz2, lzma


def _kind(path: Path) -> str | None:
    """txt, jsonl or parquet, by the suffix under any compression suffix (docs.jsonl.zst is jsonl)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    for ending in ("", *COMPRESSIONS):
        for suffix, kind in ((".txt", "txt"), (".jsonl", "jsonl")):
            if name.endswith(suffix + ending):
                return kind
    return None


def compression(path: Path) -> str | None:
    return path.suffix.lower() if path.suffix.lower() in COMPRESSIONS else None


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file's frames, one after another. zstandard's own stream reader
    ends quietly where a file was cut off mid-frame; this one raises EOFError there."""

    def __init__(self, raw):
        import zstandard

        self.raw, self.new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.in_frame, self.pending, self.offset = self.new_frame(), False, b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.offset >= len(self.pending):
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.in_frame:
                    raise EOFError("the last zstd frame is cut off")
                return 0
            self.pending, self.offset = self._decompress(chunk), 0
        n = min(len(buffer), len(self.pending) - self.offset)
        buffer[:n] = self.pending[self.offset : self.offset + n]
        self.offset += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self.frame.decompress(data))
            self.in_frame = True
            if not self.frame.eof:
                break
            data, self.frame, self.in_frame = self.frame.unused_data, self.new_frame(), False
        return b"".join(out)


class BinaryLines:
    """A corpus file as binary lines, decompressed on the fly where compressed, and how far into the file
    on disk it has read (`position`, for progress in the unit of the files' sizes). A truncated or corrupt
    compressed file is a one-line error naming it."""

    def __init__(self, path: Path):
        self.path, self.raw = path, open(path, "rb")
        kind = compression(path)
        if kind is None:
            self.stream = self.raw
        elif kind == ".zst":
            self.stream = io.BufferedReader(ZstdFrames(self.raw), buffer_size=1 << 20)
        elif kind == ".gz":
            self.stream = gzip.GzipFile(fileobj=self.raw, mode="rb")
        else:
            self.stream = (bz2.BZ2File if kind == ".bz2" else lzma.LZMAFile)(self.raw, "rb")

    def __enter__(self) -> BinaryLines:
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()
        self.raw.close()

    def __iter__(self) -> Iterator[bytes]:
        damaged = (EOFError, OSError, lzma.LZMAError, ValueError)
        try:
            yield from self.stream
        except damaged as e:
            raise UserError(
                f"{self.path}: a damaged or truncated {compression(self.path)} file "
                f"({str(e).splitlines()[0][:120]}); download or compress it again"
            ) from None

    def position(self) -> int:
        return self.raw.tell()

    def skip_to_line(self, offset: int) -> int:
        """Move to the first line that starts at or after byte `offset` (uncompressed files only) -> its
        byte offset."""
        if offset <= 0:
            return 0
        if compression(self.path):
            raise ValueError(f"{self.path}: a compressed file is read from its start")
        self.raw.seek(offset - 1)
        self.raw.readline()  # the rest of the line holding byte offset - 1, its newline included
        return self.raw.tell()


def lines_before(path: Path, offset: int) -> int:
    """How many lines of an uncompressed file end before byte `offset`."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def hf_files(spec: str) -> tuple[list[Path], dict]:
    """The parquet files of a hub dataset matching the glob, and what was read: repo, revision (the
    snapshot's commit), pattern, whether the hub was offline (then only the local cache is seen)."""
    repo_id, _, pattern = spec[len("hf:") :].partition(":")
    pattern = pattern or "*.parquet"
    if repo_id.count("/") != 1:
        raise UserError(
            f"--corpus {spec}: expected hf:ORG/NAME[:GLOB], "
            f"e.g. hf:HuggingFaceFW/fineweb-edu:sample/10BT/*.parquet"
        )
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=[pattern]))
    except Exception as e:  # network, auth, or not in the offline cache: all are the user's to fix
        raise UserError(
            f"--corpus {spec}: could not fetch from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    files = sorted(
        p for p in local.rglob("*.parquet") if fnmatch.fnmatch(p.relative_to(local).as_posix(), pattern)
    )
    if not files:
        raise UserError(f"--corpus {spec}: no parquet files match '{pattern}' in {repo_id}")
    from huggingface_hub import constants

    return files, {
        "repo": repo_id,
        "revision": local.name,
        "pattern": pattern,
        "offline": bool(constants.HF_HUB_OFFLINE),
        "files": [p.relative_to(local).as_posix() for p in files],
    }


def glob_paths(spec: str) -> list[Path]:
    """What glob.glob(spec, recursive=True) matches, but `**` never descends through a directory symlink
    (pathlib's rule): glob.glob follows them, so a link loop (`a/up -> ..`) made it grow without bound.
    Hidden names match only a pattern that names them, as in glob.glob."""
    parts = Path(spec).parts
    magic = next(i for i, part in enumerate(parts) if any(ch in part for ch in "*?["))
    anchor, pattern = Path(*parts[:magic]) if magic else Path(), "/".join(parts[magic:])
    shown = pattern.startswith(".") or "/." in pattern
    return sorted(
        p
        for p in anchor.glob(pattern)
        if shown or not any(part.startswith(".") for part in p.relative_to(anchor).parts)
    )


def resolve_files(spec: str) -> list[CorpusFile]:
    if spec == "stdlib":
        return [CorpusFile(p, "py", spec) for p in stdlib_files()]
    if spec.startswith("hf:"):
        files, _ = hf_files(spec)
        return [CorpusFile(p, "parquet", spec) for p in files]
    path = Path(spec)
    if any(ch in spec for ch in "*?["):
        candidates = glob_paths(spec)
    elif path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
    elif path.is_file():
        if not _kind(path):
            raise UserError(
                f"{path}: unsupported file type; "
                f"use .txt, .jsonl (either may end in .gz, .zst, .bz2 or .xz) or .parquet"
            )
        candidates = [path]
    else:
        raise UserError(f"{path}: corpus not found; give a file, directory, glob, 'stdlib' or hf:ORG/NAME")
    files = [CorpusFile(p, _kind(p), spec) for p in candidates if p.is_file() and _kind(p)]
    if not files:
        raise UserError(f"{spec}: no .txt, .jsonl or .parquet files found")
    return files
