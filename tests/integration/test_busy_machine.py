"""A CPU run on a machine whose cores other work keeps busy: with OMP_NUM_THREADS unset, torch runs one
thread per core, each step waits for the busy ones (the quickstart ran 11x slower beside one busy
process on 2 cores), and the trainer says so in one line, with the setting that fixes it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import tiny_overrides

from pretrainer.core.hardware import usable_cores

BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def train_without_thread_settings(stdlib_data, tmp_path, name: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    args = tiny_overrides(stdlib_data, tmp_path / name, **{"train.max_steps": 2, "eval.every": 0})
    done = subprocess.run(
        [sys.executable, "-m", "pretrainer", "train", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.quiet  # it reads how busy the machine is
def test_busy_cores_are_named_at_start_with_the_fix(stdlib_data, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    assert usable_cores() == len(cores)
    from pretrainer.train.describe import crowded_cores_warning

    assert crowded_cores_warning(len(cores)) == ""  # an idle machine, a thread per core: nothing to say
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)]) for core in cores]
    try:
        said = train_without_thread_settings(stdlib_data, tmp_path, "busy")
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    warnings = [line for line in said.splitlines() if "cores busy" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: other processes keep "), said
    assert "--train.threads=1 (or set OMP_NUM_THREADS=1)" in warnings[0]
