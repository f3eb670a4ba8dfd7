"""A CPU run on a machine whose cores other work keeps busy: with OMP_NUM_THREADS unset, torch runs one
thread per core, each step waits for the busy ones (the quickstart ran 11x slower beside one busy
process on 2 cores), and the trainer says so in one line, with the setting that fixes it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_config

from pretrainer.core.hardware import cores_busy_elsewhere, usable_cores
from pretrainer.train.describe import crowded_cores_warning
from pretrainer.train.loop import train

BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@pytest.mark.quiet(alone=True)  # it reads how busy the machine is
def test_busy_cores_are_named_at_start_with_the_fix(stdlib_data, tmp_path, monkeypatch, capsys):
    cores = sorted(os.sched_getaffinity(0))
    assert usable_cores() == len(cores)
    assert crowded_cores_warning(len(cores)) == ""  # an idle machine, a thread per core: nothing to say
    # as a fresh process starts: no OMP_NUM_THREADS, torch's default of a thread per core
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)]) for core in cores]
    try:
        torch.set_num_threads(len(cores))
        train(tiny_config(stdlib_data, tmp_path / "run", **{"train.max_steps": 1, "eval.every": 0}))
    finally:
        torch.set_num_threads(threads)
        for loop in loops:
            loop.kill()
            loop.wait()
    said = capsys.readouterr()
    warnings = [line for line in (said.out + said.err).splitlines() if "other processes keep" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: other processes keep "), said.out
    assert "--train.threads=1 (or set OMP_NUM_THREADS=1)" in warnings[0]


@pytest.mark.quiet(alone=True)  # it reads how busy the machine is
def test_load_outside_this_process_s_cores_is_not_named(tmp_path):
    """An allocation of some of a node's cores (SLURM, taskset) beside another job busy on the rest:
    only the cores this process may run on count, so a thread per allocated core draws no warning."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one busy outside the allocation, one in it")
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cores[-1])])
    try:
        assert cores_busy_elsewhere() > 0.5  # the loop runs, on a core of this process's: it counts
        os.sched_setaffinity(0, cores[:-1])  # an allocation without that core: it does not
        assert usable_cores() == len(cores) - 1
        assert cores_busy_elsewhere() < 0.5 and crowded_cores_warning(len(cores) - 1) == ""
    finally:
        os.sched_setaffinity(0, cores)
        loop.kill()
        loop.wait()
