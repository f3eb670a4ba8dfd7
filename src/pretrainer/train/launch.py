"""`pretrainer train --nproc N`: torchrun on this machine, with the run's exit code as the contract.

    pretrainer train CONFIG --nproc 8 [overrides]   ~   TORCH_ELASTIC_SHUTDOWN_TIMEOUT=S torchrun --standalone
                                                        --nproc_per_node=8 -m pretrainer train CONFIG ...

What the wrapper adds to a plain torchrun:
- exit status: torchrun exits 1 whenever a worker exits non-zero, so a budget stop (4) looks like a
  crash to a scheduler. Rank 0 writes the exit record (train/stopping.py) to a file this wrapper
  names in $PRETRAINER_EXIT_FILE; the wrapper exits with its code.
- signals: torchrun runs in its own session; a stop signal to the wrapper is forwarded once per grace
  window (repeats are the same request) to the workers and to torchrun (TERM, INT and HUP; USR1 and
  USR2, which torchrun does not handle, to the workers only). The workers hear it first: torchrun,
  signalled twice (by the wrapper and by a `pkill` to every process), shuts down with SIGTERM. torchrun
  waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT = parallel.shutdown_timeout_s before any SIGKILL, so the
  workers have time to finish their step and write the checkpoint.
- no orphans: the wrapper is a child subreaper, so workers that outlive torchrun (a signal sent to
  every process can cut torchrun's own wait short) are still waited for, up to the same grace,
  before the exit record is read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrainer.core.errors import (
    EXIT_CRASH,
    EXIT_FILE_ENV,
    SIGNAL_REPEAT_GRACE_S,
    STOP_SIGNAL_NAMES,
    exit_code_for_signal,
    read_exit_record,
)
from pretrainer.train.run_end import after_the_run, tell

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux), so it can wait for them."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pretrainer",
        "train",
        *train_args,
    ]


# the stop signals torchrun's agent handles by sending the same signal to its workers; it does not
# handle SIGUSR1/SIGUSR2 (their default action would end it without a word to the workers)
TORCHRUN_FORWARDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def children_of(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def own_children() -> list[int]:
    """This process's children (after torchrun exits: the workers re-parented to this subreaper)."""
    return children_of(os.getpid())


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def wait_for_descendants(grace_s: float) -> None:
    """Wait for workers that outlived torchrun; SIGKILL them after grace_s."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0 and time.monotonic() > deadline:
            signal_all(own_children(), signal.SIGKILL)
            deadline = float("inf")
        if pid == 0:
            time.sleep(0.1)


def launch(nproc: int, shutdown_timeout_s: float, train_args: list[str]) -> int:
    """Run torchrun with the train arguments and return the run's exit code (RUN_DIR/exit.json's)."""
    exit_file = Path(tempfile.mkdtemp(prefix="pretrainer-exit-")) / "exit.json"
    subreaper = become_subreaper()
    last_forwarded, launched = {"at": -SIGNAL_REPEAT_GRACE_S - 1}, []

    def forward(signum, frame):  # once per grace window (repeats are the same request): to torchrun, which
        now = time.monotonic()  # forwards to its workers, or, once it is gone, to the workers it left behind
        if launched and now - last_forwarded["at"] > SIGNAL_REPEAT_GRACE_S:
            last_forwarded["at"] = now
            torchrun = launched[0]
            if torchrun.poll() is not None:
                signal_all(own_children(), signum)
            elif signum in TORCHRUN_FORWARDS:  # the workers first: torchrun turns a second signal during its
                # shutdown into SIGTERM (its finally-block default), so they must hear this one before that
                signal_all(children_of(torchrun.pid), signum)
                signal_all([torchrun.pid], signum)
            else:  # USR1/USR2 would kill torchrun: straight to its workers
                signal_all(children_of(torchrun.pid), signum)

    stop_signals = [getattr(signal, name) for name in STOP_SIGNAL_NAMES]
    previous = {sig: signal.signal(sig, forward) for sig in stop_signals}
    try:
        # its own session (as each worker has): a terminal's Ctrl-C reaches torchrun once, through forward()
        child = subprocess.Popen(
            torchrun_command(nproc, train_args),
            start_new_session=True,
            env={
                **os.environ,
                EXIT_FILE_ENV: str(exit_file),
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(shutdown_timeout_s)),
            },
        )
        launched.append(child)
        torchrun_code = child.wait()
        if subreaper:
            wait_for_descendants(shutdown_timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    record = read_exit_record(exit_file)
    shutil.rmtree(exit_file.parent, ignore_errors=True)
    if record is None:  # rank 0 never got to write one (killed, or died before its run dir existed)
        code = exit_code_for_signal(-torchrun_code) if torchrun_code < 0 else (torchrun_code or EXIT_CRASH)
        tell(f"pretrainer: no exit record from rank 0; torchrun exited {torchrun_code}; exiting {code}")
        return code
    tell(
        f"pretrainer: run ended: {record['reason']} (exit {record['exit_code']}) at step {record['step']}"
        + (f"; checkpoint {record['checkpoint']}" if record.get("checkpoint") else "")
    )
    # after torchrun and every worker: a requeue, or the run's on_exit hook (rank 0 left it to us)
    after_the_run(record, record.get("on_exit", ""), float(record.get("on_exit_timeout_s", 600)))
    return record["exit_code"]
