"""Helpers shared by the tests split from test_scaling.py."""

from __future__ import annotations

import csv
from pathlib import Path

from helpers import tiny_overrides

SWEEP_SETTINGS = {
    "eval.tasks_every": 0,
    "log.every": 10,
    "ckpt.every": 20,
    "eval.every": 40,
    "optim.warmup_steps": 4,
}


def sweep_args(data: Path, out: Path, sizes: str, tokens: str, *extra: str) -> list[str]:
    base = [
        o for o in tiny_overrides(data, out / "unused", **SWEEP_SETTINGS) if not o.startswith("--run.dir")
    ]
    return ["sweep", "--sizes", sizes, "--tokens", tokens, "--out", str(out), *base, *extra]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
