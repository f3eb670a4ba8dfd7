"""Helpers shared by the tests split from test_gpu_ready.py."""

from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
