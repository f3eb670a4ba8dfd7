"""Helpers shared by the tests split from test_lowbit.py."""

from pretrainer.artifacts.metrics import read_metrics

LOW_BIT = ["adamw8bit", "adamw4bit"]


def records(run_dir) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")
