"""The system packages scripts/install-test-deps.sh installs (SLURM, Chromium): `make test` starts it in
the background, and a test that needs one waits here until it has finished."""

from __future__ import annotations

import os
import time
from pathlib import Path

STATE = Path(os.environ.get("PRETRAINER_TEST_DEPS_STATE", "/tmp/pretrainer-test-deps"))


def wait_for_test_deps(timeout_s: float = 600) -> None:
    """Return once no install is running (finished, failed, or never started: then the test's own check
    says what is missing)."""
    deadline = time.monotonic() + timeout_s
    while not (STATE / "done").exists() and time.monotonic() < deadline:
        try:
            os.kill(int((STATE / "pid").read_text()), 0)
        except (OSError, ValueError):  # no install running
            return
        time.sleep(0.5)
