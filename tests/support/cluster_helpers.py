"""Helpers shared by the tests split from test_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path


def exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())
