"""The $ guard: stop a run gracefully before it spends more than its cap.

Contract (the X1 lab's): a sidecar keeps budget.json current with

    {"spent_usd": 12.4, "rate_usd_per_hr": 1.1, "hours_elapsed": 11.3,
     "projected_total_usd": 27.9, "last_update_utc": "2026-11-21T06:00:00Z"}

and the trainer reads it every budget.check_every_s seconds:
    spent > warn_usd          -> a warning in the logs and metrics (once)
    projected total > cap_usd -> checkpoint, then exit with EXIT_BUDGET_PROJECTED (4)
    spent > cap_usd           -> exit at once, no checkpoint, with EXIT_BUDGET_SPENT (5)
Without a file, or when it is missing, stale (older than stale_after_s) or malformed, the guard
says so and uses its own estimate: spent = usd_per_gpu_hour x GPUs x elapsed hours, projected =
spent + the same rate x the remaining steps at the average step time so far.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pretrainer.artifacts.metrics import run_timings
from pretrainer.config.schema import BudgetConfig
from pretrainer.core.errors import EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT, UserError
from pretrainer.core.hardware import training_seconds
from pretrainer.train.distributed import DistEnv, broadcast_object

FIELDS = ("spent_usd", "rate_usd_per_hr", "hours_elapsed", "projected_total_usd", "last_update_utc")
ACTION_CODES = {"ok": 0, "warn": 1, "stop": 2, "halt": 3}  # ordered: the most severe wins across ranks


@dataclass
class Reading:
    spent_usd: float
    projected_total_usd: float
    rate_usd_per_hr: float
    source: str  # "file" or "estimate"
    problem: str = ""  # why the file was not used


@dataclass
class Decision:
    action: str  # "ok", "warn", "stop" (checkpoint and exit) or "halt" (exit now)
    reading: Reading
    message: str

    @property
    def exit_code(self) -> int:
        return {"stop": EXIT_BUDGET_PROJECTED, "halt": EXIT_BUDGET_SPENT}.get(self.action, 0)


def parse_budget(raw: str, now: float, stale_after_s: float) -> tuple[Reading | None, str]:
    """budget.json text -> (reading, "") or (None, what is wrong with it)."""
    try:
        data = json.loads(raw)
        missing = [f for f in FIELDS if f not in data]
        if missing:
            return None, f"malformed (missing {', '.join(missing)})"
        values = {f: float(data[f]) for f in FIELDS if f != "last_update_utc"}
        if not all(math.isfinite(v) and v >= 0 for v in values.values()):  # -100 spent raised the cap
            return None, "malformed (negative or non-finite numbers)"
        updated = datetime.fromisoformat(str(data["last_update_utc"]).replace("Z", "+00:00"))
        if updated.tzinfo is None:
            updated = updated.replace(tzinfo=timezone.utc)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        return None, f"malformed ({type(e).__name__})"
    age = now - updated.timestamp()
    if age > stale_after_s:
        return None, f"stale (last update {age / 60:.1f} min ago, limit {stale_after_s / 60:.1f} min)"
    return Reading(values["spent_usd"], values["projected_total_usd"], values["rate_usd_per_hr"], "file"), ""


def decide(reading: Reading, cap_usd: float, warn_usd: float) -> Decision:
    where = "budget.json" if reading.source == "file" else "estimate"
    summary = (
        f"spent ${reading.spent_usd:.2f}, projected ${reading.projected_total_usd:.2f}, cap "
        f"${cap_usd:.2f} ({where})"
    )
    if reading.spent_usd > cap_usd:
        return Decision("halt", reading, f"budget exceeded: {summary}; exiting now without a checkpoint")
    if reading.projected_total_usd > cap_usd:
        return Decision("stop", reading, f"projected cost over the cap: {summary}; checkpointed, exiting")
    if reading.spent_usd > warn_usd:
        return Decision("warn", reading, f"budget warning: {summary}")
    return Decision("ok", reading, summary)


def estimated_spend_usd(usd_per_gpu_hour: float, gpus: int, seconds: float) -> float:
    """The estimate used without (or instead of a bad) budget.json: price x GPUs x time."""
    return usd_per_gpu_hour * gpus * max(seconds, 0.0) / 3600


NOT_REGULAR = "not a regular file"


def _read_text(path: Path) -> str | None:
    """The file's text; None when missing or unreadable; NOT_REGULAR for a FIFO, device or directory
    (opened without blocking: a FIFO with no writer would hang the run, and ignore SIGTERM, in open())."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return NOT_REGULAR
        try:
            return f.read(1 << 20).decode("utf-8", errors="replace")
        except OSError:
            return None


class BudgetGuard:
    def __init__(
        self,
        cfg: BudgetConfig,
        gpus: int,
        clock: Callable[[], float] = time.time,
        reader: Callable[[Path], str | None] = _read_text,
    ):
        self.cfg, self.gpus, self.clock, self.reader = cfg, gpus, clock, reader
        self.warn_usd = cfg.warn_usd or 0.8 * cfg.cap_usd
        self.next_check = clock()
        self.warned = False
        self.reported: set[str] = set()  # file problems already reported

    def estimate(self, elapsed_s: float, remaining_s: float) -> Reading:
        spent = estimated_spend_usd(self.cfg.usd_per_gpu_hour, self.gpus, elapsed_s)
        projected = spent + estimated_spend_usd(self.cfg.usd_per_gpu_hour, self.gpus, remaining_s)
        return Reading(spent, projected, self.cfg.usd_per_gpu_hour * self.gpus, "estimate")

    def read(self, elapsed_s: float, remaining_s: float) -> Reading:
        if not self.cfg.file:
            return self.estimate(elapsed_s, remaining_s)
        raw = self.reader(Path(self.cfg.file))
        reading, problem = (
            (None, "missing")
            if raw is None
            else (None, f"{NOT_REGULAR} (a FIFO or device?)")
            if raw == NOT_REGULAR
            else parse_budget(raw, self.clock(), self.cfg.stale_after_s)
        )
        if reading is not None:
            return reading
        fallback = self.estimate(elapsed_s, remaining_s)
        fallback.problem = f"{self.cfg.file} is {problem}; using the estimate"
        return fallback

    def check(self, elapsed_s: float, remaining_s: float, force: bool = False) -> Decision | None:
        """A decision when a check is due (every check_every_s of the clock), else None."""
        now = self.clock()
        if not force and now < self.next_check:
            return None
        self.next_check = now + self.cfg.check_every_s
        decision = decide(self.read(elapsed_s, remaining_s), self.cfg.cap_usd, self.warn_usd)
        if decision.action == "warn":
            if self.warned:
                decision.action = "ok"  # warn once per run
            self.warned = True
        return decision


def launch_cost_check(
    budget: BudgetConfig,
    training_flops: float,
    steps_left: int,
    *,
    gpus: int,
    peak_tflops: float | None,
    elapsed_before_s: float,
    say: Callable[[str], None],
    measured_step_s: float | None = None,
) -> None:
    """Refuse to start when the spend so far (estimated) plus the projected cost of the remaining
    steps exceeds budget.cap_usd. The remaining steps are timed by this run's own measured step time
    when it has one (a resume: its earlier launches' metrics), else at budget.mfu of the device's peak."""
    if not budget.cap_usd:
        return
    if measured_step_s:
        seconds, basis = (
            steps_left * measured_step_s,
            f"{measured_step_s:.3f} s per step (measured by this run)",
        )
    elif not peak_tflops:
        say("budget: no peak TFLOP/s for this device (set budget.peak_tflops); launch cost not projected")
        return
    else:
        seconds = training_seconds(training_flops, gpus, peak_tflops, budget.mfu)
        basis = f"MFU {budget.mfu:g} (assumed)"
    projected = estimated_spend_usd(budget.usd_per_gpu_hour, gpus, elapsed_before_s + seconds)
    say(f"budget: projected ${projected:.2f} (cap ${budget.cap_usd:.2f}) for {steps_left:,} steps at {basis}")
    if projected > budget.cap_usd and not budget.allow_over_cap:
        raise UserError(
            f"budget: the plan projects ${projected:.2f} for the remaining {steps_left:,} steps ({basis}, "
            f"${budget.usd_per_gpu_hour:g}/GPU-hour x {gpus}), over budget.cap_usd ${budget.cap_usd:.2f}; "
            f"lower train.max_steps or pass --budget.allow_over_cap=true"
        )


def measured_step_s(run_dir: Path, saved: dict, world_size: int, step_tokens: int) -> float | None:
    """The step time a run's earlier launches measured, when they ran the same step: as many ranks and
    tokens per step as this launch (`saved`: the checkpoint's state). None: too few logged steps, or a
    different step."""
    if saved.get("hardware", {}).get("world_size") != world_size:
        return None
    try:
        timings = run_timings(run_dir)
    except UserError:
        return None
    return timings["step_s"] if timings["tokens_per_step"] == step_tokens else None


def resumed_step_s(
    budget: BudgetConfig, run_dir: Path, saved: dict | None, env: DistEnv, step_tokens: int
) -> float | None:
    """For a resumed run's launch check under a cap: the measured step time, read by rank 0 (before the
    metrics are cut back to the checkpoint) and given to every rank, so all decide alike."""
    if saved is None or not budget.cap_usd:
        return None
    return broadcast_object(
        measured_step_s(run_dir, saved, env.world_size, step_tokens) if env.is_main else None, env
    )
