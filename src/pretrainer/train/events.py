"""What happens in a run that a person should hear of, as typed events: each carries its metrics.jsonl
record and says which alert it is and in what words. A component logs one through the run log
(`log(Spike(record))`); the run log writes its record like any other and hands the event to its
subscribers (the alerts), which act on its type, never on the record's keys.

    log(BudgetWarning({"step": 40, "budget_warn": 1.0, "spent_usd": 3.2, ...}))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pretrainer.core.errors import EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT


@dataclass
class Event:
    record: dict  # the metrics.jsonl record, "step" included
    alert: ClassVar[str] = ""  # the alert kind it raises

    @property
    def step(self) -> int:
        return self.record["step"]

    @property
    def alert_kind(self) -> str:
        return self.alert

    def message(self) -> str:
        return ""


class BudgetWarning(Event):
    alert = "budget_warning"

    def message(self) -> str:
        return f"spent ${self.record.get('spent_usd', 0):,.2f}"


class BudgetStop(Event):
    alert = "budget_stop"

    def message(self) -> str:
        return f"projected ${self.record.get('projected_usd', 0):,.2f}: exit {EXIT_BUDGET_PROJECTED}"


class BudgetHalt(Event):
    alert = "budget_halt"

    def message(self) -> str:
        return f"spent ${self.record.get('spent_usd', 0):,.2f}: exit {EXIT_BUDGET_SPENT}, no checkpoint"


class Spike(Event):
    alert = "spike"

    @property
    def alert_kind(self) -> str:  # a non-finite loss is its own alarm
        return "spike" if math.isfinite(self.record.get("spike_loss", 0)) else "non_finite"

    def message(self) -> str:
        loss, grad_norm = self.record.get("spike_loss", 0), self.record.get("spike_grad_norm", 0)
        return f"loss {loss:.4g}, grad norm {grad_norm:.4g}"


class SpikeRegime(Event):
    alert = "spike_regime"

    def message(self) -> str:
        return f"loss {self.record.get('loss_at_regime', 0):.4g}: a new regime"


class RolledBack(Event):
    alert = "rollback"

    def message(self) -> str:
        return f"rolled back to step {self.record.get('to_step')}"


class InvalidTokens(Event):
    alert = "invalid_tokens"

    def message(self) -> str:
        return f"token ids up to {self.record.get('max_token_id')}"


class ThroughputLow(Event):
    alert = "throughput"

    def message(self) -> str:
        return "throughput below train.min_mfu / min_tokens_per_s"


# a budget decision's action -> its event
BUDGET_EVENTS = {"warn": BudgetWarning, "stop": BudgetStop, "halt": BudgetHalt}
