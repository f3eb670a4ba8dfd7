"""Why a run stops, decided the same way on every rank, and the record of why it ended.

    signals = StopSignal(); signals.install()          # at once: a signal during setup is kept too
    stopper = Stopper.build(trainer)                   # a trainer component (train/component.py)
    stopper.vote(step, votes)                          # "budget", "signal", "time_limit"
    request = stopper.stop_request(step, agreed)       # once per step: None, or why to stop
    write_exit_record(run_dir, *exit_status(error), step, error)   # RUN_DIR/exit.json, at every exit

Three sources of a stop here: a signal on any rank (spot preemption, scancel, pkill, Ctrl-C), a
wall-clock limit, and the budget guard on rank 0 (budget.json or the $ estimate, see budget.py).
Before each step every rank casts its votes into the trainer's one small host-side all-reduce (max;
distributed.agree_max, no device sync), so all ranks stop at the same step and write one checkpoint
together. Which stop wins, and whether it checkpoints, is core/end_reasons.py's table.

RUN_DIR/exit.json is the contract with schedulers and launchers: {"reason", "exit_code", "step",
"checkpoint", "message", "time_utc"}, written atomically by rank 0 however the process ends:
  finished 0 | error 2 (bad input) or 1 (crash) | collective_timeout 3 | budget_stop 4 |
  budget_halt 5 | throughput_stop 6 (train.watchdog_action = "stop") | write_fault 7 | time_limit 8
  (train.max_hours, or a SLURM job's end less run.stop_margin_s) | signal 128+N (143 SIGTERM, 130 SIGINT,
  129 SIGHUP, 138 SIGUSR1, 140 SIGUSR2; "checkpoint" says whether one was written)
Inside a SLURM job a signal in run.requeue_signals (USR1, USR2 by default) and the job's end also
requeue it: "requeued": true, and run_end.after_the_run calls `scontrol requeue`.
`pretrainer train --nproc N` exits with that code, not torchrun's.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.config.schema import BudgetConfig
from pretrainer.core.errors import (
    EXIT_BUDGET_PROJECTED,
    EXIT_BUDGET_SPENT,
    EXIT_FILE_ENV,
    EXIT_TIME_LIMIT,
    SIGNAL_REPEAT_GRACE_S,
    STOP_SIGNAL_NAMES,
    exit_code_for_signal,
)
from pretrainer.core.files import atomic_write_json
from pretrainer.core.secrets import redact
from pretrainer.train.budget import ACTION_CODES, BudgetGuard, estimated_spend_usd
from pretrainer.train.component import Component, Step, StopRequest, Votes, stopped_with_checkpoint
from pretrainer.train.console import resume_command
from pretrainer.train.distributed import DistEnv, broadcast_object
from pretrainer.train.events import BUDGET_EVENTS
from pretrainer.train.slurm import SlurmJob, requeue_signal_numbers


class StopSignal:
    """SIGTERM / SIGINT (spot preemption, scancel, pkill, Ctrl-C), SIGHUP (the terminal or SSH session
    that started the run closed), SIGUSR1 / SIGUSR2 (a SLURM job's warning before its time limit):
    remember it; the loop finishes the step, every rank agrees, one checkpoint is written, the process
    exits with 128 + the signal.

    The same stop is often signalled several times: SLURM and pkill signal the launcher *and* every
    worker, and torchrun forwards its own copy. A repeat within SIGNAL_REPEAT_GRACE_S is the same request.
    Only a SIGINT after that, a deliberate second Ctrl-C, interrupts at once (no checkpoint); a
    repeated SIGTERM never does: schedulers follow it with SIGKILL when their own grace runs out."""

    def __init__(self):
        self.signum, self.first_at, self.previous = 0, 0.0, {}

    def install(self) -> None:
        # signal handlers live in the main thread only
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNAL_NAMES:
                sig = getattr(signal, name)
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if not self.signum:
            self.signum, self.first_at = signum, now
        elif signum == signal.SIGINT and now - self.first_at > SIGNAL_REPEAT_GRACE_S:
            raise KeyboardInterrupt

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


LIMIT_MAX_HOURS, LIMIT_JOB_END = 1, 2  # TimeLimits.reached: which wall-clock limit is near


@dataclass
class TimeLimits:
    """The wall-clock limits a run stops itself before, with a checkpoint: train.max_hours over all
    its launches, and a SLURM job's end less run.stop_margin_s (whether or not a signal comes)."""

    max_hours: float = 0.0
    stop_at: float | None = None  # epoch seconds: the job's end less the margin
    job_id: str = ""
    margin_s: float = 0.0

    @classmethod
    def of(cls, max_hours: float, stop_margin_s: float, job: SlurmJob | None) -> TimeLimits:
        if job is None or job.end_time is None or not stop_margin_s:
            return cls(max_hours)
        return cls(max_hours, job.end_time - stop_margin_s, job.job_id, stop_margin_s)

    def reached(self, run_elapsed_s: float, step_time_s: float, now: float) -> int:
        """LIMIT_* when the next step and the checkpoint after it (two step times) would pass a limit."""
        ahead = 2 * step_time_s
        if self.stop_at is not None and now + ahead >= self.stop_at:
            return LIMIT_JOB_END
        if self.max_hours and run_elapsed_s + ahead >= self.max_hours * 3600:
            return LIMIT_MAX_HOURS
        return 0

    def message(self, limit: int, resume: str) -> str:
        if limit == LIMIT_MAX_HOURS:
            return f"train.max_hours = {self.max_hours:g} reached: {resume}"
        end = (self.stop_at or 0) + self.margin_s
        ends = datetime.fromtimestamp(end, timezone.utc).strftime("%H:%M:%S UTC") if self.stop_at else "soon"
        return (
            f"SLURM job {self.job_id} ends at {ends}; stopped run.stop_margin_s = {self.margin_s:g} s "
            f"before: {resume}"
        )


def write_exit_record(
    run_dir: Path,
    reason: str,
    exit_code: int,
    step: int | None,
    error: BaseException | None,
    *,
    into_run_dir: bool = True,
    launcher_only: dict | None = None,
) -> dict:
    """RUN_DIR/exit.json (only into a run dir that exists: bad input leaves no output dir; and not
    when `into_run_dir` is false: a trainer that found the run dir in use writes nothing there) and
    the launcher's $PRETRAINER_EXIT_FILE when set (with `launcher_only`: what the launcher does after
    the run, kept out of the run dir). "requeued": the stop asked for the SLURM job's requeue.
    Atomic: a reader sees the old record or the new one."""
    checkpoint = latest_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    # absolute, as every saved path: a relative one means nothing to a reader in another directory
    run_dir, checkpoint = Path(run_dir).absolute(), checkpoint.absolute() if checkpoint else None
    record = {
        "reason": reason,
        "exit_code": exit_code,
        "step": step,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "message": redact(str(error).splitlines()[0])[:500] if error is not None and str(error) else "",
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "requeued": bool(getattr(error, "requeue", False)),
        "run_dir": str(run_dir),
    }
    targets = [Path(run_dir) / "exit.json"] if into_run_dir and Path(run_dir).is_dir() else []
    targets += [Path(os.environ[EXIT_FILE_ENV])] if os.environ.get(EXIT_FILE_ENV) else []
    for path in targets:
        try:
            launcher = str(path) == os.environ.get(EXIT_FILE_ENV)
            atomic_write_json(path, {**record, **(launcher_only or {})} if launcher else record)
        except OSError as e:  # a full disk: the record is lost, the run's files are not
            print(f"warning: {path}: cannot write the exit record ({e.strerror})", file=sys.stderr)
    return record


class Stopper(Component):
    """The stop decision's own side: signals, the SLURM job's end and train.max_hours, the budget guard.
    Its votes ("budget", "signal", "time_limit") are agreed across ranks with the others'."""

    name, state_key = "stopping", "spent_usd"

    @classmethod
    def build(cls, trainer) -> Stopper:
        cfg, env = trainer.cfg, trainer.env
        # None outside SLURM; read on rank 0 (its end time may need squeue) so every rank stops alike
        job = broadcast_object(SlurmJob.from_env() if env.is_main else None, env)
        for warning in job.warnings if job is not None and env.is_main else ():
            trainer.say(warning)
        stopper = cls(
            cfg.budget,
            env,
            trainer.signals,
            trainer.budget_clock,
            trainer.run_log.write,
            say=trainer.say,
            resume_command=resume_command(cfg, env),
            limits=TimeLimits.of(cfg.train.max_hours, cfg.run.stop_margin_s, job),
            requeue_on=requeue_signal_numbers(cfg.run.requeue_signals, job),
        )
        stopper.run_clock, stopper.max_steps = trainer.run_clock, cfg.train.max_steps
        stopper.hang_drill_step = cfg.parallel.hang_drill_step
        stopper.start(trainer.state.step)
        return stopper

    def vote(self, step: Step, votes: Votes) -> None:
        budget, signum, limit = self.local_view(
            step.number - 1, self.run_clock.elapsed(), self.max_steps, self.hang_drill_step
        )
        votes.cast("budget", budget)
        votes.cast("signal", signum)
        votes.cast("time_limit", limit)

    def stop_request(self, step: Step, agreed: dict[str, int]) -> StopRequest | None:
        return self.request(step.number - 1, agreed["budget"], agreed["signal"], agreed["time_limit"])

    def metrics(self, step: Step) -> dict:
        if not (self.budget.cap_usd or self.budget.usd_per_gpu_hour):
            return {}
        return {"spent_usd": self.spent_usd(step.record["elapsed_s"])}

    def state_dict(self) -> float:
        return self.spent_usd(self.run_clock.elapsed())

    def __init__(
        self,
        budget: BudgetConfig,
        env: DistEnv,
        signals: StopSignal,
        clock: Callable[[], float],
        log: Callable[[dict], None],
        *,
        say: Callable[[str], None],
        resume_command: str = "the same command",
        limits: TimeLimits | None = None,
        requeue_on: frozenset[int] = frozenset(),
    ):
        self.budget, self.env, self.signal, self.log, self.say = budget, env, signals, log, say
        self.limits, self.requeue_on = limits or TimeLimits(), requeue_on  # requeue_on: signal numbers
        self.resume_command = resume_command  # said when a stop leaves a checkpoint
        self.guard = (
            BudgetGuard(budget, env.world_size, clock=clock) if budget.cap_usd and env.is_main else None
        )
        self.reading = None  # the budget guard's latest reading (budget.json or the estimate)
        self.first_step = 0
        # (time, step) the step-time estimate counts from: the end of this process's first step, so that
        # start-up, step 0's evaluation and the first step's compile are not projected onto every step
        self.timed_from: tuple[float, int] | None = None
        self.polls = 0  # local_view calls in this process: the first comes before any step has run

    def start(self, first_step: int) -> None:
        """`first_step`: the step this process starts from."""
        self.first_step = first_step
        if self.limits.stop_at is not None and self.limits.stop_at <= time.time():
            self.say(
                f"warning: SLURM job {self.limits.job_id} ends in less than run.stop_margin_s = "
                f"{self.limits.margin_s:g} s: the run stops before its first step, without a requeue; "
                f"ask for more time or lower run.stop_margin_s"
            )

    def step_time(self, step: int) -> float:
        """Seconds per step since this process's first step ended (evaluations and checkpoints
        included: they cost money too); 0 until a second step has run."""
        now = time.time()
        if self.timed_from is None:
            if step > self.first_step:
                self.timed_from = (now, step)
            return 0.0
        since, from_step = self.timed_from
        return (now - since) / (step - from_step) if step > from_step else 0.0

    def spent_usd(self, elapsed_s: float) -> float:
        if self.reading is not None:
            return self.reading.spent_usd
        return estimated_spend_usd(self.budget.usd_per_gpu_hour, self.env.world_size, elapsed_s)

    def local_view(self, step: int, elapsed_s: float, max_steps: int, hang_drill_step: int = 0) -> list[int]:
        """This rank's side of the stop decision after `step` completed steps: [budget action code,
        signal number, time limit (LIMIT_*)]. The loop agrees on it across ranks (with its other per-step
        flags) and passes the agreed values to `request`."""
        if hang_drill_step and step == hang_drill_step and self.env.rank == self.env.world_size - 1 > 0:
            self.hang()  # the drill: this rank stops answering before the agreement
        budget_action = ACTION_CODES["ok"]
        self.polls += 1
        # after a step of this process: its time projects the rest
        step_time = self.step_time(step)
        limit = self.limits.reached(elapsed_s, step_time, time.time())
        if self.guard is not None and self.polls > 1:
            decision = self.guard.check(elapsed_s, (max_steps - step) * step_time)
            if decision is not None:
                self.reading = decision.reading
                problem = decision.reading.problem
                if problem and problem not in self.guard.reported:
                    self.guard.reported.add(problem)
                    self.say(f"budget: {problem}")
                    self.log({"step": step, "budget_problem": 1.0})
                if decision.action != "ok":
                    self.say(decision.message)
                    event = BUDGET_EVENTS[decision.action]
                    self.log(
                        event(
                            {
                                "step": step,
                                f"budget_{decision.action}": 1.0,
                                "spent_usd": decision.reading.spent_usd,
                                "projected_usd": decision.reading.projected_total_usd,
                            }
                        )
                    )
                budget_action = ACTION_CODES[decision.action]
        return [budget_action, self.signal.signum, limit]

    def request(self, step: int, budget_action: int, signum: int, limit: int = 0) -> StopRequest | None:
        """From the agreed budget action, signal and time limit: None, or why to stop after `step`
        completed steps (the first that applies, in the end-reason table's order)."""
        cap = f"budget.cap_usd ${self.budget.cap_usd:.2f}"
        if budget_action == ACTION_CODES["halt"]:
            return StopRequest(
                "budget_halt",
                f"budget: spent over {cap} at step {step}; stopped without a checkpoint",
                EXIT_BUDGET_SPENT,
            )
        resume = stopped_with_checkpoint(step, self.resume_command)
        if budget_action == ACTION_CODES["stop"]:
            return StopRequest(
                "budget_stop", f"budget: projected cost over {cap}: {resume}", EXIT_BUDGET_PROJECTED
            )
        requeue = " (the SLURM job is requeued)"
        if signum:
            again = signum in self.requeue_on
            return StopRequest(
                "signal",
                f"signal {signal.Signals(signum).name}: {resume}{requeue if again else ''}",
                exit_code_for_signal(signum),
                requeue=again,
            )
        if limit:  # a launch that trained no step before the job's end would requeue forever: it stops
            again = limit == LIMIT_JOB_END and bool(self.requeue_on) and step > self.first_step
            message = self.limits.message(limit, resume) + (requeue if again else "")
            return StopRequest("time_limit", message, EXIT_TIME_LIMIT, requeue=again)
        return None

    def hang(self) -> None:
        """Stop answering, as a dead or stuck rank does, until signalled (torchrun ends the others)."""
        self.say(f"rank {self.env.rank}: hang drill, not answering")
        while not self.signal.signum:
            time.sleep(0.1)
