"""The suite's `quiet` marker (support/quiet_tests.py): under `pytest -n 2` a quiet test's run overlaps
no other test's, while the other tests do run side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TIMED = """
import json, time, pytest

def timed(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open("{log}", "a") as log:
        log.write(json.dumps([name, start, time.monotonic()]) + "\\n")
"""


def test_a_quiet_test_runs_alone_and_the_others_side_by_side(tmp_path):
    log = tmp_path / "times.jsonl"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_a.py").write_text(
        TIMED.format(log=log) + "".join(f"def test_a{i}(): timed('a{i}', 0.3)\n" for i in range(4))
    )
    (tmp_path / "test_b.py").write_text(
        TIMED.format(log=log)
        + "def test_b0(): timed('b0', 0.3)\n"
        + "@pytest.mark.quiet\ndef test_quiet(): timed('quiet', 0.6)\n"
        + "def test_b1(): timed('b1', 0.3)\n"
    )
    tests_dir = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "support.quiet_tests"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tests_dir), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {name: (start, end) for name, start, end in map(json.loads, log.read_text().splitlines())}
    assert len(spans) == 7

    def overlap(x, y):
        return min(spans[x][1], spans[y][1]) > max(spans[x][0], spans[y][0])

    assert not [name for name in spans if name != "quiet" and overlap(name, "quiet")], spans
    assert any(overlap(f"a{i}", f"b{j}") for i in range(4) for j in range(2)), spans  # two workers did run
