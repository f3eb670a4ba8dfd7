"""Atomic file writes and hashing, shared by every writer in the package.

A reader must never see a half-written file: write to a temp name in the same directory,
fsync, then rename (atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pretrainer.core.errors import UserError
from pretrainer.core.ownership import check_replaceable, mark_output


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def naming(error: BaseException, path: Path) -> BaseException:
    """`error`, naming `path` if it is an OSError that names no file (write(), flush() and fsync() give
    none), so a full disk's one line says which file."""
    if isinstance(error, OSError) and error.filename is None:
        return OSError(error.errno, error.strerror, str(path))
    return error


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def atomic_write_bytes(path: Path, data: bytes, kind: str | None = None) -> None:
    """`data` in `path`, or (disk full, a signal) `path` as it was and no temp file left. kind: as
    atomic_file's."""
    with atomic_file(path, kind) as tmp:
        tmp.write_bytes(data)


def _present(path: Path) -> bool:
    """Whether anything is at `path`: a broken link too."""
    return path.exists() or path.is_symlink()


@contextlib.contextmanager
def atomic_file(path: Path, kind: str | None = None) -> Iterator[Path]:
    """Yield a temp path beside `path` for a writer that wants a file name (gguf's writer); when the
    block succeeds the file is fsynced and renamed onto `path`, when it fails it is removed and `path`
    is as it was. kind: `path` is an output of that kind (core/ownership.py), replaced only if the
    ownership rule allows it then; no kind: one of a run's or a command's own files."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if kind is not None and _present(path):
            check_replaceable(path, kind)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        named = naming(e, path)
        if named is e:  # anything else (a signal, a named OSError) goes on as it came
            raise
        raise named from None
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def current_umask() -> int:
    """The process umask, read without setting it where Linux reports it (os.umask can only swap it,
    which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, with the mode every other file gets (0666 minus the umask):
    save_file creates its file 0600, unreadable to the rest of a group on a shared filesystem."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


class _HashingWriter:
    """A binary file whose writes are hashed (sha256) and counted as they go."""

    def __init__(self, file):
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def write_hashed(path: Path, write: Callable[[Any], Any]) -> dict:
    """write(file) into `path`, fsynced -> {"bytes", "sha256"} of what was written: a checkpoint's hashes
    without reading gigabytes back (rank 0 re-reading 15 GB held every GPU for seconds per checkpoint)."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        write(writer)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": writer.size, "sha256": writer.digest.hexdigest()}


CHUNK_BYTES = 16 << 20  # a data file's sha256 is also kept per 16 MiB chunk, for a sampled check


class ChunkedSha256:
    """sha256 of a stream, whole and per CHUNK_BYTES chunk, fed as it is written."""

    def __init__(self):
        self.whole, self.chunk, self.filled, self.chunks = hashlib.sha256(), hashlib.sha256(), 0, []

    def update(self, data: bytes) -> None:
        self.whole.update(data)
        view = memoryview(data)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self.filled)
            self.chunk.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == CHUNK_BYTES:
                self.chunks.append(self.chunk.hexdigest())
                self.chunk, self.filled = hashlib.sha256(), 0

    def chunk_digests(self) -> list[str]:
        return self.chunks + ([self.chunk.hexdigest()] if self.filled else [])

    def hexdigest(self) -> str:
        return self.whole.hexdigest()


def sha256_chunk(path: Path, index: int) -> str:
    with open(path, "rb") as f:
        f.seek(index * CHUNK_BYTES)
        return hashlib.sha256(f.read(CHUNK_BYTES)).hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def check_output(out: Path, kind: str = "file") -> None:
    """Before any work: `out` can be written as a `kind` ("file" or "directory"): not an existing
    directory where a file goes, and its nearest existing parent a writable directory (missing ones are
    made then)."""
    out = Path(out)
    if kind == "file" and out.is_dir():
        raise UserError(f"{out}: is a directory; give a file path for --out")
    parent = nearest_existing(out.parent)
    if not parent.is_dir():
        raise UserError(f"{out}: cannot be made, {parent} is a file, not a directory; choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{out}: cannot write into {parent} (read-only or not yours); choose another --out")


def pid_alive(pid: str) -> bool:
    """Whether a process with this id runs on this machine (a non-number: assume it does)."""
    try:
        os.kill(int(pid), 0)
    except ValueError:
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def _remove_path(path: Path) -> None:
    """A directory tree, a file or a link, gone (what is already gone, or cannot go, left as it is)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def atomic_directory(out: Path, kind: str | None = None, replace: bool = True) -> Iterator[Path]:
    """Yield a temp directory beside `out`; when the block succeeds it replaces `out` (which only now
    disappears, if it existed), when it fails it is removed and `out` is untouched. (A fault after the new
    `out` is in place, while the old copy is removed, is still raised: the new `out` stays.)

    kind: `out` is an output of that kind (core/ownership.py): marked as one, written while no other
    process writes it (else one line), and an existing `out` replaced only if the ownership rule allows it
    then, and only if `replace` (an `out` another process wrote meanwhile is never replaced). No kind: a
    run's own directory (a checkpoint), which its run-dir lock owns."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"  # the replaced `out`, until the new one is in place
    # left by a process killed between its two renames (the old copy is whole then), or while it removed
    # the old copy after them, or by this process stopped then
    for left in out.parent.glob(f".{out.name}.old-*"):
        if left == old or not pid_alive(left.name.rsplit("-", 1)[-1]):
            if not _present(out):
                with contextlib.suppress(FileNotFoundError):  # another process put it back first
                    os.replace(left, out)  # the only complete copy: put it back
            else:
                _remove_path(left)
    for stale in [tmp, *out.parent.glob(f".{out.name}.tmp-*")]:
        if stale == tmp or not pid_alive(stale.name.rsplit("-", 1)[-1]):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        elif kind is not None:
            raise UserError(
                f"{out}: another process (pid {stale.name.rsplit('-', 1)[-1]}) is writing it now; wait for "
                f"it to end, or choose another --out"
            )
    set_aside = False
    try:  # the mkdir inside: a signal's exception right after it (a stop mid-prepare) still removes tmp
        tmp.mkdir()
        yield tmp
        if kind is not None:
            mark_output(tmp, kind)
        if _present(out):
            if kind is not None and not replace:
                raise UserError(
                    f"{out}: another process wrote it while this one worked; it is kept and this output "
                    f"discarded; pass --force to replace it, or choose another --out"
                )
            if kind is not None:
                check_replaceable(out, kind)
            os.replace(out, old)
            set_aside = True
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if set_aside and not _present(out):  # stopped between the two renames: the old copy goes back whole
            with contextlib.suppress(OSError):  # (else the next writer puts it back)
                os.replace(old, out)
        raise
    finally:  # removed only once the new copy is in place: a stop or kill -9 mid-removal loses nothing
        if set_aside and _present(out):
            _remove_path(old)


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as a PNG, written atomically, and closed."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
