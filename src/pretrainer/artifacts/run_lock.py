"""One owner per run dir: an advisory lock (flock) on the run dir itself and on RUN_DIR/.lock, held
by the one trainer that writes the run (rank 0 under torchrun, for the whole job). The kernel releases
both when the process ends however it ends, so a kill -9 never leaves a stale lock; the file only says
who holds it now.

A second trainer on the same run dir (a double-submitted job, a requeue racing a manual restart)
stops before it writes anything, with one line naming the holder's PID and host. The directory's lock
holds even if someone removes or replaces .lock (the trainer then puts the file back); where the file
system cannot lock a directory (some network mounts), the file's lock alone holds, and the trainer
checks before each step that .lock is still the file it locked. A run dir moved or replaced under a
running trainer, or its lock taken by another, stops that trainer without another write there (`lost`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.files import pid_alive

LOCK_FILE = ".lock"
HOLDER_NAMED_WITHIN_S = 1.0  # the holder names itself in .lock microseconds after locking it
NO_FLOCK_FIX = (
    "this file system does not support file locks (NFS without its lock service, some FUSE mounts); "
    "choose a run.dir on a local or parallel file system that does"
)


def _ended_here(said: str) -> bool:
    """Whether .lock's "pid N on HOST" names a process of this host that has ended."""
    words = said.split()
    if len(words) != 4 or words[0] != "pid" or words[2] != "on" or words[3] != socket.gethostname():
        return False
    return not pid_alive(words[1])


def _same_file(path: Path, fd: int) -> bool:
    try:
        here, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None  # RUN_DIR/.lock, locked
        self.dir_fd: int | None = None  # RUN_DIR itself, locked (None where the file system cannot)
        self.created: list[Path] = []  # the directories acquire() made, deepest first

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _holder(self, wait_s: float = 0.0) -> str:
        """Who .lock says holds the run dir. A holder makes .lock and writes its name right after it takes
        the directory's lock: a trainer that arrives in between finds .lock absent, empty or still naming
        the run's previous trainer (a process of this host that has ended), and waits up to wait_s for the
        name."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                said = (self.run_dir / LOCK_FILE).read_text(errors="replace")[:256].strip()
            except FileNotFoundError:
                said = ""
            except OSError:
                return "another process"
            named = said if said and not _ended_here(said) else ""
            if named or time.monotonic() >= deadline:
                return named or "another process"
            time.sleep(0.01)

    def _in_use(self) -> UserError:
        return UserError(
            f"{self.run_dir}: in use by {self._holder(HOLDER_NAMED_WITHIN_S)}, which is training this run; "
            "one trainer per run dir (wait for it to end, or choose another run.dir)"
        )

    def acquire(self) -> None:
        """Take the lock (making the run dir if it is new), or raise UserError naming its holder."""
        if self.fd is not None:
            return
        try:
            if not self.run_dir.is_dir():
                self.created = [d for d in [self.run_dir, *self.run_dir.parents] if not d.exists()]
                self.run_dir.mkdir(parents=True, exist_ok=True)
            dir_fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:  # a file where the run dir goes, a read-only mount, a full disk
            raise UserError(
                f"{self.run_dir}: cannot be the run dir ({e.strerror}); choose another run.dir"
            ) from None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.dir_fd = dir_fd
        except BlockingIOError:
            os.close(dir_fd)
            self.created = []  # the holder's now
            raise self._in_use() from None
        except OSError:  # a directory cannot be locked here: the file's lock alone, checked every step
            os.close(dir_fd)
        try:
            fd = self._lock_file()
        except BaseException:
            self._release_dir()
            raise
        if fd is None:
            self._release_dir()
            self.created = []
            raise self._in_use()
        self.fd = fd

    def _lock_file(self) -> int | None:
        """RUN_DIR/.lock opened, locked and naming this process -> its fd; None if another holds it."""
        try:
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(
                f"{self.run_dir}: cannot be the run dir ({e.strerror}); choose another run.dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks at all here
            os.close(fd)
            self._remove_created()
            raise UserError(
                f"{self.run_dir}: cannot lock {LOCK_FILE} ({e.strerror}): {NO_FLOCK_FIX}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd

    def lost(self) -> str | None:
        """Before a step: None while the run dir is still this trainer's, else why it is not (one line).
        A removed or replaced .lock is put back while the directory's own lock holds."""
        if self.fd is None:
            return None
        if self.dir_fd is not None and not _same_file(self.run_dir, self.dir_fd):
            return (
                f"{self.run_dir}: the run dir was moved or replaced while this trainer ran; it stops without "
                f"another write there (one trainer per run dir)"
            )
        if _same_file(self.run_dir / LOCK_FILE, self.fd):
            return None
        if self.dir_fd is not None:  # removed or replaced by hand: the directory's lock still holds
            fd = None
            with contextlib.suppress(UserError):  # it cannot be made again: stop, as below
                fd = self._lock_file()
            if fd is not None:
                os.close(self.fd)
                self.fd = fd
                return None
        return (
            f"{self.run_dir}: its {LOCK_FILE} was removed or replaced and {self._holder()} holds it now; "
            f"this trainer stops without another write there (one trainer per run dir)"
        )

    def abandon(self) -> None:
        """The run dir is another's now (`lost`): release everything, write nothing more there."""
        self._release_dir()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.created = []

    def _release_dir(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def _remove_created(self) -> None:
        """A new run dir that nothing was written to goes again, with any parents acquire() made."""
        if self.created:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
            for directory in self.created:
                try:
                    directory.rmdir()
                except OSError:  # not empty: something else is in it
                    break
        self.created = []

    def close(self, remove_created: bool = False) -> None:
        """Release the lock (closing the files does). remove_created: a new run dir that nothing was
        written to (bad input stopped the run first) goes again, with any parents acquire() made."""
        if self.fd is None:
            return
        if remove_created:
            self._remove_created()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None
        self._release_dir()
