"""Helpers shared by the tests split from test_budget.py."""

import json
from datetime import datetime, timezone
from pathlib import Path

T0 = 1_900_000_000.0  # the fake clock's start (2030)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def budget_file(path: Path, spent: float, projected: float, updated: float = T0) -> Path:
    path.write_text(
        json.dumps(
            {
                "spent_usd": spent,
                "rate_usd_per_hr": 1.1,
                "hours_elapsed": spent / 1.1,
                "projected_total_usd": projected,
                "last_update_utc": iso(updated),
            }
        )
    )
    return path


class FakeClock:
    """A clock that moves `tick` seconds each time it is read, and by sleep(): a `clock` argument, or,
    with tick=0, the `time` module of the code under test (time(), perf_counter())."""

    def __init__(self, start: float = T0, tick: float = 1.0):
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    time = perf_counter = __call__

    def sleep(self, seconds: float) -> None:
        self.now += seconds
