"""One owner per run dir: an advisory lock (flock) on RUN_DIR/.lock, held by the one trainer that
writes the run (rank 0 under torchrun, for the whole job). The kernel releases it when the process
ends however it ends, so a kill -9 never leaves a stale lock; the file only says who holds it now.

A second trainer on the same run dir (a double-submitted job, a requeue racing a manual restart)
stops before it writes anything, with one line naming the holder's PID and host."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from pretrainer.core.errors import UserError

LOCK_FILE = ".lock"


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.created: list[Path] = []  # the directories acquire() made, deepest first

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        """Take the lock (making the run dir if it is new), or raise UserError naming its holder."""
        if self.fd is not None:
            return
        try:
            if not self.run_dir.is_dir():
                self.created = [d for d in [self.run_dir, *self.run_dir.parents] if not d.exists()]
                self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a file where the run dir goes, a read-only mount, a full disk
            raise UserError(
                f"{self.run_dir}: cannot be the run dir ({e.strerror}); choose another run.dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            self.created = []  # the holder's now
            raise UserError(
                f"{self.run_dir}: in use by {holder}, which is training this run; one trainer per run dir "
                f"(wait for it to end, or choose another run.dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def close(self, remove_created: bool = False) -> None:
        """Release the lock (closing the file does). remove_created: a new run dir that nothing was
        written to (bad input stopped the run first) goes again, with any parents acquire() made."""
        if self.fd is None:
            return
        if remove_created and self.created:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
            for directory in self.created:
                try:
                    directory.rmdir()
                except OSError:  # not empty: something else is in it
                    break
        os.close(self.fd)
        self.fd = None
