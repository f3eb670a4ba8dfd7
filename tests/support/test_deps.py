"""The system packages scripts/install-test-deps.sh installs (SLURM, Chromium): `make test` starts it in
the background, holding STATE/lock while it installs; a test that needs one waits here for that lock."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

STATE = Path(os.environ.get("PRETRAINER_TEST_DEPS_STATE", f"/tmp/pretrainer-test-deps-{os.getuid()}"))


def wait_for_test_deps(timeout_s: float = 600) -> bool:
    """True once no install holds the lock (it finished or failed, or none ran: then the test's own check
    says what is missing); False after `timeout_s`."""
    lock = STATE / "lock"
    if not lock.is_file():
        return True
    deadline = time.monotonic() + timeout_s
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)
