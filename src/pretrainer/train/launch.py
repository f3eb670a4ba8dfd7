"""`pretrainer train --nproc N`: torchrun on this machine, with the run's exit code as the contract.

    pretrainer train CONFIG --nproc 8 [overrides]   ==   torchrun --standalone --nproc_per_node=8
                                                         --shutdown-timeout=S -m pretrainer train ...

What the wrapper adds to a plain torchrun:
- exit status: torchrun exits 1 whenever a worker exits non-zero, so a budget stop (4) looks like a
  crash to a scheduler. Rank 0 writes the exit record (train/stopping.py) to a file this wrapper
  names in $PRETRAINER_EXIT_FILE; the wrapper exits with its code.
- signals: SIGTERM/SIGINT to the wrapper are forwarded once to torchrun (repeats within the grace
  window are the same request), and torchrun gets `--shutdown-timeout=parallel.shutdown_timeout_s`
  so the workers have time to finish their step and write the checkpoint before any SIGKILL.
- no orphans: the wrapper is a child subreaper, so workers that outlive torchrun (a repeated signal
  can cut torchrun's own wait short) are still waited for before the exit record is read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrainer.errors import EXIT_CRASH, exit_code_for_signal
from pretrainer.train.stopping import EXIT_FILE_ENV, REPEAT_GRACE_S, read_exit_record

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux), so it can wait for them."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def wait_for_descendants() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def torchrun_command(nproc: int, shutdown_timeout_s: float, train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--shutdown-timeout={int(shutdown_timeout_s)}", "-m", "pretrainer", "train", *train_args]


def launch(nproc: int, shutdown_timeout_s: float, train_args: list[str]) -> int:
    """Run torchrun with the train arguments and return the run's exit code (RUN_DIR/exit.json's)."""
    exit_file = Path(tempfile.mkdtemp(prefix="pretrainer-exit-")) / "exit.json"
    subreaper = become_subreaper()
    child = subprocess.Popen(torchrun_command(nproc, shutdown_timeout_s, train_args), env={**os.environ, EXIT_FILE_ENV: str(exit_file)})
    last_forwarded = {"at": -REPEAT_GRACE_S - 1}

    def forward(signum, frame):  # once per grace window: the workers treat repeats as the same request
        now = time.monotonic()
        if now - last_forwarded["at"] > REPEAT_GRACE_S and child.poll() is None:
            last_forwarded["at"] = now
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        torchrun_code = child.wait()
        if subreaper:
            wait_for_descendants()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    record = read_exit_record(exit_file)
    exit_file.unlink(missing_ok=True)
    exit_file.parent.rmdir()
    if record is None:  # rank 0 never got to write one (killed, or died before its run dir existed)
        code = exit_code_for_signal(-torchrun_code) if torchrun_code < 0 else (torchrun_code or EXIT_CRASH)
        print(f"pretrainer: no exit record from rank 0; torchrun exited {torchrun_code}; exiting {code}", file=sys.stderr)
        return code
    print(f"pretrainer: run ended: {record['reason']} (exit {record['exit_code']}) at step {record['step']}"
          + (f"; checkpoint {record['checkpoint']}" if record.get("checkpoint") else ""), file=sys.stderr)
    return record["exit_code"]
