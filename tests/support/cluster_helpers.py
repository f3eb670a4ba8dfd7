"""Helpers shared by the tests split from test_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())
