"""What every trainer component is: one concern (checkpoints, spikes, stopping, speed, evaluation,
alerts, the console, norms, profiling, ...) behind a few hooks, each with a do-nothing default.

    class MyComponent(Component):
        name = "mine"
        def after_step(self, step): ...            # one hook, the rest stay defaults

The trainer (train/trainer.py) calls the hooks of its components in registry order
(train/components.py): around each step, on logging steps for their metrics, between steps for
work that takes time, and at the end. A component that can stop the run or drop a batch says so
through `vote`; the trainer agrees on every vote across ranks at once (one host-side all-reduce of
named fields) and acts on the result: `stop_request` then says why to stop, if its vote won.
A component owns its state: `state_dict()` goes into state.json under `state_key`, and
`load_state_dict` gets it back on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Step:
    """One optimizer step as the hooks see it; filled in as the step goes."""

    number: int  # 1-based, as in every log
    logging: bool  # a logging step: the host reads values from the device
    last: bool  # the run's last step in this process
    cursor: int = 0  # the data position the step reads from (a stop puts it back)
    micro_batches: list = field(default_factory=list)
    counts: tuple = ((), 0)  # counted targets: (per micro-batch on this rank, the whole step's)
    lr: float = 0.0
    loss: torch.Tensor | None = None  # on the device, the same on every rank
    grad_norm: torch.Tensor | None = None
    group_norms: dict = field(default_factory=dict)  # per layer group, before clipping (logging steps)
    skip: torch.Tensor | None = None  # 1.0 on the device: the update was dropped
    tokens: int = 0  # the run's tokens once the step is done
    record: dict | None = None  # a logging step's record: as far as it goes in metrics(), whole after


@dataclass
class StopRequest:
    reason: str  # a stop's name in core/end_reasons.py's table
    message: str
    exit_code: int  # the row's, but a signal's own (128 + N); whether to checkpoint is the row's
    requeue: bool = False  # inside SLURM: requeue the job once the checkpoint and exit record are written


def stopped_with_checkpoint(step: int, resume_command: str) -> str:
    """What a stop that writes a checkpoint says of it."""
    return f"checkpoint written at step {step}; resume with: {resume_command}"


class Votes:
    """A step's votes, by name: each component casts its own (0: nothing to say), the largest value
    across ranks wins. Every rank casts the same names (its components are the same)."""

    def __init__(self):
        self.values: dict[str, int] = {}

    def cast(self, name: str, value: int) -> None:
        self.values[name] = max(self.values.get(name, 0), int(value))

    def agree(self, agree_max) -> dict[str, int]:
        """`agree_max(list) -> list`: the element-wise largest over ranks (train/distributed.py)."""
        names = sorted(self.values)
        return dict(zip(names, agree_max([self.values[name] for name in names])))


class Component:
    name = ""  # its registry name
    state_key = ""  # its part of state.json ("": it saves nothing)

    def before_step(self, step: Step) -> None:
        """The step begins (its batch not read yet)."""

    def vote(self, step: Step, votes: Votes) -> None:
        """Before the step trains: cast this rank's votes (stop, drop the batch)."""

    def stop_request(self, step: Step, agreed: dict[str, int]) -> StopRequest | None:
        """After the agreement: why to stop, when a vote of this component's won."""
        return None

    def after_step(self, step: Step) -> None:
        """The update is done (nothing read from the device yet)."""

    def metrics(self, step: Step) -> dict[str, Any]:
        """A logging step's figures, merged into its record (the device has been waited for;
        step.record holds the record so far: step, loss, lr, tokens, elapsed_s, ...)."""
        return {}

    def after_log(self, step: Step) -> None:
        """Every step, once a logging step's record is written (step.record; None on other steps)."""

    def between_steps(self, step: Step) -> bool:
        """Work between steps (evaluations, checkpoints). -> True when it took time: the speed
        measurement then starts again after it."""
        return False

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """`state`: what state_dict() returned, read back from a checkpoint's state.json."""

    def close(self) -> None:
        """The run has ended, however it ended."""
