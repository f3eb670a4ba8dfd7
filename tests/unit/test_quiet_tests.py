"""The suite's `quiet` marker (support/quiet_tests.py): under `make test`'s `pytest -n 2 --dist loadfile` the
quiet tests run after every other test has ended, a file's quiet tests on one worker, two at once on the
two workers; a quiet(alone=True) test runs first among them and overlaps no other test; the other tests
run side by side, each file on one worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TIMED = """
import json, os, time, pytest

def timed(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open("{log}", "a") as log:
        log.write(json.dumps([name, start, time.monotonic(), os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_quiet_tests_run_after_the_others_two_at_once_and_alone_ones_alone(tmp_path):
    log = tmp_path / "times.jsonl"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_a.py").write_text(
        TIMED.format(log=log)
        + "".join(f"def test_a{i}(): timed('a{i}', 0.3)\n" for i in range(4))
        + "@pytest.mark.quiet\ndef test_quiet_a(): timed('quiet_a', 1.0)\n"
        + "@pytest.mark.quiet\ndef test_quiet_a2(): timed('quiet_a2', 1.0)\n"
    )
    (tmp_path / "test_b.py").write_text(
        TIMED.format(log=log)
        + "def test_b0(): timed('b0', 0.3)\n"
        + "@pytest.mark.quiet\ndef test_quiet_b(): timed('quiet_b', 1.0)\n"
        + "def test_b1(): timed('b1', 0.3)\n"
    )
    (tmp_path / "test_c.py").write_text(
        TIMED.format(log=log) + "@pytest.mark.quiet(alone=True)\ndef test_alone(): timed('alone', 0.3)\n"
    )
    tests_dir = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
        + ["-p", "support.quiet_tests"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tests_dir), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    spans = {name: (start, end) for name, start, end, _ in runs}
    worker = {name: worker for name, *_, worker in runs}
    assert len(spans) == 10

    def overlap(x, y):
        return min(spans[x][1], spans[y][1]) > max(spans[x][0], spans[y][0])

    quiet = ["alone", "quiet_a", "quiet_a2", "quiet_b"]
    others = [name for name in spans if name not in quiet]
    assert min(spans[q][0] for q in quiet) >= max(spans[name][1] for name in others), spans  # after them all
    assert not [name for name in spans if name != "alone" and overlap(name, "alone")], spans
    assert spans["alone"][1] <= min(spans[q][0] for q in quiet if q != "alone"), spans  # the alone ones first
    # a file's quiet tests on one worker; two files' at once, on the two workers
    assert worker["quiet_a"] == worker["quiet_a2"] != worker["quiet_b"], worker
    assert overlap("quiet_a", "quiet_b") or overlap("quiet_a2", "quiet_b"), spans
    assert (
        len({worker[f"a{i}"] for i in range(4)}) == len({worker["b0"], worker["b1"]}) == 1
    )  # a file: a worker
    assert any(overlap(f"a{i}", f"b{j}") for i in range(4) for j in range(2)), spans  # two workers did run
