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

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self, create: bool) -> None:
        """Take the lock, or raise UserError naming its holder. create=False: only where the run dir
        exists already (a run that bad input stops early leaves no run dir behind); create=True: make
        the run dir first (just before the first write)."""
        if self.fd is not None:
            return
        if not self.run_dir.is_dir():
            if not create:
                return
            self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(
                f"{self.run_dir}: in use by {holder}, which is training this run; one trainer per run dir "
                f"(wait for it to end, or choose another run.dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def close(self) -> None:
        """Release the lock (closing the file does)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
