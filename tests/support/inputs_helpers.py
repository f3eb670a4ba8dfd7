"""Helpers shared by the tests split from test_inputs.py."""

from __future__ import annotations

import json
from pathlib import Path


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())
