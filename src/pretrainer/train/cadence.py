"""When the periodic checkpoints fall: every `ckpt.every` steps, or, with ckpt.every = auto, at the
interval that wastes least for the declared rate of interruptions (Young 1974, Daly 2006):

    interval ~ sqrt(2 x write time x mean time between interruptions)

Shorter, and the checkpoints' own time dominates; longer, and an interruption throws away more work
(half an interval on average). The trainer measures both of its inputs itself: the training thread's
time per checkpoint (the first auto checkpoint is written at the first logging step to measure it)
and the step time from the logged tokens/s, and decides again after every checkpoint. `plan`
prints the same choice from a probe's or a finished run's measurements.

    steps = young_daly_steps(write_s=4.0, step_s=0.5, interruptions_per_hour=0.25)   # 679
"""

from __future__ import annotations

import math

from pretrainer.train.distributed import DistEnv, agree_max

AUTO = -1  # ckpt.every = "auto"


def young_daly_seconds(write_s: float, interruptions_per_hour: float) -> float:
    """The checkpoint interval in seconds for a write of `write_s` seconds and that interruption rate."""
    return math.sqrt(2 * write_s * 3600 / interruptions_per_hour)


def young_daly_steps(write_s: float, step_s: float, interruptions_per_hour: float) -> int:
    """The same interval in whole steps of `step_s` seconds (at least one)."""
    return max(1, round(young_daly_seconds(write_s, interruptions_per_hour) / step_s))


def preemption_cost(
    wall_s: float, every_steps: int, step_s: float, *, write_s: float, startup_s: float, per_hour: float
) -> dict:
    """What interruptions at `per_hour` cost a run of `wall_s` seconds checkpointing every `every_steps`:
    each loses half an interval of steps on average and a start-up; every checkpoint costs `write_s`."""
    interruptions = per_hour * wall_s / 3600
    checkpoints = wall_s / (every_steps * step_s + write_s)
    lost_s = interruptions * (every_steps * step_s / 2 + startup_s)
    return {"interruptions": interruptions, "lost_s": lost_s, "checkpoint_s": checkpoints * write_s}


class CheckpointCadence:
    """Which steps write a periodic checkpoint. With a number of steps, its multiples. With auto, the
    first logging step (to measure the write), then the Young/Daly interval from the measured write and
    step times, decided again after each checkpoint: the largest rank's choice, so every rank agrees
    (a checkpoint is a collective)."""

    def __init__(
        self, every: int, interruptions_per_hour: float, first_step: int, *, env: DistEnv, log, align: int = 1
    ) -> None:
        """align: auto's checkpoints fall on multiples of it (eval.every under ckpt.keep_best, whose
        ranking needs a validation at the checkpoint's step)."""
        self.every, self.per_hour, self.env, self.log = every, interruptions_per_hour, env, log
        self.align = max(1, align)
        self.next_step = first_step  # auto: the step of the next checkpoint
        self.step_s: float | None = None
        self.chosen = 0  # auto's interval in steps, once chosen

    def due(self, step: int) -> bool:
        if self.every != AUTO:
            return bool(self.every) and step % self.every == 0
        return self.step_s is not None and step >= self.next_step and step % self.align == 0

    def measured_step(self, step_s: float) -> None:
        """A logged interval's seconds per step (tokens per step / tokens/s)."""
        if step_s > 0:
            self.step_s = step_s

    def checkpointed(self, step: int, write_s: float) -> None:
        """After a checkpoint that took the training thread `write_s`: auto picks the next one."""
        if self.every != AUTO or self.step_s is None:
            return
        steps = agree_max([young_daly_steps(write_s, self.step_s, self.per_hour)], self.env)[0]
        changed, self.next_step = steps != self.chosen, step + steps
        self.chosen = steps
        if changed:  # the interval and why, whenever it moves
            self.log(
                {
                    "step": step,
                    "ckpt_every": steps,
                    "ckpt_write_s": write_s,
                    "ckpt_step_s": self.step_s,
                    "interruptions_per_hour": self.per_hour,
                }
            )
