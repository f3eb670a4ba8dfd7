"""Every way a run ends, in one table: from a row come the process's exit code, RUN_DIR/exit.json's
"reason", the CLI's code and line, each tracker's final status and the last alert's kind.

    reason = end_reason_of(error)            # None (no error): finished
    reason.name, reason.exit_code(error)     # "budget_stop", 4
    reason.tracker_status                    # "FINISHED", "KILLED" (stopped on purpose) or "FAILED"
    reason.alert_kind                        # "finished", "stopped" or "died"
    winner = first_stop(["signal", "budget_halt"])   # several stops at one step: the highest priority

A new end reason is one row here (and the component that asks for it). Imports no torch: the
`--nproc` launcher and the CLI read it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from pretrainer.core.errors import (
    EXIT_BUDGET_PROJECTED,
    EXIT_BUDGET_SPENT,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CRASH,
    EXIT_OK,
    EXIT_SLOW,
    EXIT_TIME_LIMIT,
    EXIT_USER_ERROR,
    EXIT_WRITE_FAULT,
    RunStopped,
    UserError,
    WriteFault,
    exit_code_for_signal,
    write_fault,
)

COLLECTIVE_TIMEOUT_HINT = (
    "a collective operation timed out (parallel.timeout_s): a rank is stuck, dead or unreachable. Check "
    "every rank's log; on cloud GPUs without NVLink/InfiniBand try NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1, "
    "and NCCL_DEBUG=INFO to see the transport."
)


@dataclass(frozen=True)
class EndReason:
    name: str  # exit.json's "reason"
    code: int  # the exit code; a signal's is 128 + N (`exit_code`)
    on_purpose: bool  # stopped deliberately (a resume continues it), not failed
    checkpoint: bool  # a stop that writes a checkpoint before the process exits
    priority: int = 0  # stops asked for at the same step: the lowest number wins (0: not a stop)

    @property
    def tracker_status(self) -> str:
        if self.name == "finished":
            return "FINISHED"
        return "KILLED" if self.on_purpose else "FAILED"

    @property
    def alert_kind(self) -> str:
        if self.name == "finished":
            return "finished"
        return "stopped" if self.on_purpose else "died"

    def exit_code(self, error: BaseException | None = None) -> int:
        """The code the process exits with: a signal's number decides its own (RunStopped carries it)."""
        if isinstance(error, RunStopped):
            return error.exit_code
        if isinstance(error, KeyboardInterrupt):
            return exit_code_for_signal(signal.SIGINT)
        return self.code


# the stops first, in the order they win at one step: a run dir that is another trainer's now beats
# everything (nothing more may be written there), then no money left
END_REASONS = (
    EndReason("run_dir_lost", EXIT_USER_ERROR, on_purpose=False, checkpoint=False, priority=1),
    EndReason("budget_halt", EXIT_BUDGET_SPENT, on_purpose=True, checkpoint=False, priority=2),
    EndReason("budget_stop", EXIT_BUDGET_PROJECTED, on_purpose=True, checkpoint=True, priority=3),
    EndReason("throughput_stop", EXIT_SLOW, on_purpose=True, checkpoint=True, priority=4),
    EndReason("signal", exit_code_for_signal(signal.SIGTERM), on_purpose=True, checkpoint=True, priority=5),
    EndReason("time_limit", EXIT_TIME_LIMIT, on_purpose=True, checkpoint=True, priority=6),
    EndReason("finished", EXIT_OK, on_purpose=True, checkpoint=True),
    EndReason("error", EXIT_USER_ERROR, on_purpose=False, checkpoint=False),  # bad input: one line
    EndReason("write_fault", EXIT_WRITE_FAULT, on_purpose=False, checkpoint=False),
    EndReason("collective_timeout", EXIT_COLLECTIVE_TIMEOUT, on_purpose=False, checkpoint=False),
    EndReason("crash", EXIT_CRASH, on_purpose=False, checkpoint=False),  # a bug, out of memory: traceback
)
BY_NAME = {reason.name: reason for reason in END_REASONS}
STOPS = tuple(reason.name for reason in END_REASONS if reason.priority)


def first_stop(names) -> EndReason | None:
    """Of the stops asked for at one step, the one that wins (None: none was)."""
    asked = [BY_NAME[name] for name in names]
    return min(asked, key=lambda reason: reason.priority) if asked else None


def is_collective_timeout(error: BaseException) -> bool:
    """torch.distributed's timeouts (DistError is a RuntimeError): a stuck, dead or unreachable rank."""
    text = f"{type(error).__name__}: {error}".lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


def end_reason_of(error: BaseException | None) -> EndReason:
    """The row for how a process ended: None is a normal finish."""
    if error is None:
        return BY_NAME["finished"]
    if isinstance(error, RunStopped):
        return BY_NAME[error.reason]
    if isinstance(error, UserError):
        return BY_NAME["error"]
    if isinstance(error, WriteFault) or write_fault(error):
        return BY_NAME["write_fault"]
    if isinstance(error, KeyboardInterrupt):
        return BY_NAME["signal"]
    if is_collective_timeout(error):
        return BY_NAME["collective_timeout"]
    return BY_NAME["crash"]


def exit_status(error: BaseException | None) -> tuple[str, int]:
    """(exit.json's reason, exit code) for how a run ended. A crash is recorded as "error", as
    always: exit.json readers tell it from bad input by its code (1, not 2)."""
    reason = end_reason_of(error)
    return ("error" if reason.name == "crash" else reason.name), reason.exit_code(error)
