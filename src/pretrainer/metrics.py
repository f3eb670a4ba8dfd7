"""metrics.jsonl: one JSON object per logged step, validation pass or event, appended and flushed.

On resume the file is first cut back to the checkpoint's step (records of steps after it were
written by the interrupted run and will be recomputed), so every step appears exactly once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pretrainer.io import atomic_write_bytes


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings ("nan", "inf")
    return value


class MetricsLog:
    def __init__(self, path: Path, keep_through_step: int):
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_through_step]
        if self.path.exists() or kept:
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
