"""The exception types, every exit code, and the exit record's contract, in one place (and light:
the `--nproc` launcher imports it without importing torch).

Anything a user can fix (a missing file, a malformed corpus, an unknown config key) raises
`UserError` with a one-line message naming the file and the fix; the CLI prints it as
`error: ...` and exits with EXIT_USER_ERROR, never with a traceback. A run that stops on purpose
before max_steps (budget guard, signal) raises `RunStopped` with its exit code.
"""

# Exit codes (documented in the README). Schedulers read them: 4 and 5 mean "do not requeue".
from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2  # bad input: the message says what to fix
EXIT_COLLECTIVE_TIMEOUT = 3  # a distributed collective timed out (a rank is stuck, dead or unreachable)
EXIT_BUDGET_PROJECTED = 4  # budget: projected total over the cap; a checkpoint was written
EXIT_BUDGET_SPENT = 5  # budget: spent over the cap; stopped at once, no checkpoint
# the throughput watchdog (train.min_mfu / min_tokens_per_s, watchdog_action = "stop"); a checkpoint was
# written
EXIT_SLOW = 6
# the machine refused a write (disk full, read-only, not a directory): nothing saved was lost; fix it, resume
EXIT_WRITE_FAULT = 7
# a wall-clock limit came (train.max_hours, or a SLURM job's end less run.stop_margin_s); a checkpoint was
# written
EXIT_TIME_LIMIT = 8
EXIT_CRASH = 1  # anything unexpected (a bug, out of memory): see the traceback


EXIT_FILE_ENV = "PRETRAINER_EXIT_FILE"  # where a launcher wants rank 0's exit record too (train --nproc)
# what "checkpoint and stop" means: a scheduler's or a terminal's stop (TERM, INT), a closed terminal
# or SSH session (HUP), and the signals SLURM sites send before a time limit (--signal=USR1@120, USR2)
STOP_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def stop_signal_names(text: str) -> list[str] | None:
    """'USR1, term' -> ['SIGUSR1', 'SIGTERM']; None unless each is one of STOP_SIGNAL_NAMES."""
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    names = [name if name.startswith("SIG") else f"SIG{name}" for name in names]
    return names if names and all(name in STOP_SIGNAL_NAMES for name in names) else None


SIGNAL_REPEAT_GRACE_S = 10.0  # a stop signal repeated within this many seconds is the same request


def read_exit_record(path) -> dict | None:
    """RUN_DIR/exit.json (written by train/stopping.py): {"reason", "exit_code", "step", ...}, or None."""
    import json
    from pathlib import Path

    try:
        record = json.loads(Path(path).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("exit_code"), int) else None
    except (OSError, ValueError):
        return None


# an import name -> the name pip installs it by, where the two differ
PIP_NAMES = {"yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow"}


def missing_package_hint(error: ModuleNotFoundError) -> str | None:
    """The one line for a package a verb needs and this environment lacks (every package beyond torch is
    imported where it is used, so a missing one fails only the verb that uses it); None for a module of
    pretrainer's own, which is a bug."""
    top = (error.name or "").split(".")[0]
    if not top or top == "pretrainer":
        return None
    package = PIP_NAMES.get(top, top.replace("_", "-"))
    return (
        f"this needs the Python package {package}, which is not installed here: pip install {package} "
        f"(no network: bring it as a wheel, docs/installing.md#offline)"
    )


def exit_code_for_signal(signum: int) -> int:
    """128 + signal (143 SIGTERM, 130 SIGINT), the shell's convention: stopped by a signal after
    writing a checkpoint; `pretrainer train --run.dir=RUN_DIR` resumes."""
    return 128 + int(signum)


class UserError(Exception):
    pass


class NotThisRun(UserError):
    """A launch refused because it is not the run's own (another run's checkpoint, another model into a
    run dir): the run's files, its exit.json included, stay as its last real end left them."""


class WriteFault(Exception):
    """A write the machine refused (disk full, quota, read-only, a file where a directory goes): one
    line naming the path; whatever was saved before is intact (every write is a temp file + rename)."""


WRITE_FAULT_ERRNOS = {
    28: "no space left on the device",
    122: "disk quota exceeded",
    30: "read-only file system",
    13: "permission denied",
    20: "a file is where a directory must be",
    21: "a directory is where a file must be",
    17: "a file is where a directory must be",
}


WRITE_ONLY_ERRNOS = (28, 122, 30)  # only a write meets these; the others may come from a read


def write_fault(error: BaseException, path=None, what: str = "") -> WriteFault | None:
    """The WriteFault an OSError (or torch's or safetensors' failed write) is, or None for any other
    error. `what`: what was being written, e.g. "the checkpoint at step 40"."""
    import errno
    import shutil
    from pathlib import Path

    path = path or getattr(error, "filename", None)
    text = str(error)
    if isinstance(error, OSError) and error.errno in WRITE_FAULT_ERRNOS:
        why = WRITE_FAULT_ERRNOS[error.errno]
        writing = error.errno in WRITE_ONLY_ERRNOS or bool(what)
    elif (isinstance(error, RuntimeError) or type(error).__name__ == "SafetensorError") and any(
        sign in text for sign in ("write failed", "iostream error", "unexpected pos", "os error")
    ):  # torch.save's and safetensors' writers, when a write fails midway
        why, writing = "the write failed (a full disk?)", True
        if "os error 28" in text or "No space left" in text:
            why = WRITE_FAULT_ERRNOS[errno.ENOSPC]
        elif path is not None:
            try:
                if shutil.disk_usage(Path(path).parent).free < 1 << 20:
                    why = WRITE_FAULT_ERRNOS[errno.ENOSPC]
            except OSError:
                pass
    else:
        return None
    action = f"cannot write{' ' + what if what else ''}: " if writing else ""
    return WriteFault(
        f"{path or 'a file'}: {action}{why}; what was saved before is intact; fix it and run the same "
        f"command again"
    )


class RunStopped(Exception):
    """Training stopped on purpose before max_steps (budget guard, signal, throughput watchdog); carries
    why ("budget_stop", "budget_halt", "signal", "throughput_stop") and the exit code."""

    def __init__(self, message: str, exit_code: int, reason: str = "signal", requeue: bool = False):
        super().__init__(message)
        self.exit_code, self.reason, self.requeue = exit_code, reason, requeue
