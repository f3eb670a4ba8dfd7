"""Scaling laws: the fit recovers published laws, refuses what data cannot determine, and a CPU
sweep runs end to end, resumes after SIGTERM and feeds `plan --fit`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import fork_cli
from support.scaling_helpers import read_csv, sweep_args

from pretrainer.analysis.scaling.ladder import SweepConfig
from pretrainer.analysis.scaling.report import fit_sweep
from pretrainer.analysis.scaling.sweep_plan import TIMING_COLUMNS
from pretrainer.cli.main import main

THREADS = SweepConfig().cpu_threads  # what every run of these sweeps must train with, wherever it runs
OTHER = THREADS + 1  # this process's count, and the children's OMP_NUM_THREADS, while a sweep runs
RESUMED_ELSEWISE = "CPU threads and resumes with"  # train's warning: a resume at another thread count


def sizes_args(data: Path, out: Path, sizes: str = "1x32,2x64,3x96") -> list[str]:
    return sweep_args(data, out, sizes, "10240", "--log.every=1")  # (shapes: no search); 20 steps a run


@contextlib.contextmanager
def other_threads():
    """This process at OTHER threads around an in-process sweep (a sweep that trained with its caller's
    count would show it in its runs' state.json), and OTHER back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(OTHER)
    try:
        yield
        assert torch.get_num_threads() == OTHER, "the sweep did not give back its caller's thread count"
    finally:
        torch.set_num_threads(before)


def threads_used(sweep: Path) -> dict[str, set[int]]:
    """Each run's CPU thread counts, as every checkpoint it keeps recorded them (state.json hardware)."""
    return {
        run.name: {
            json.loads(state.read_text())["hardware"]["cpu_threads"]
            for state in run.glob("checkpoints/*/state.json")
        }
        for run in sorted((sweep / "runs").iterdir())
    }


def each(*runs: str) -> dict[str, set[int]]:
    return {run: {THREADS} for run in runs}


@pytest.fixture(scope="module")
def straight(stdlib_data, tmp_path_factory) -> Path:
    """The sweep run straight through, in this process."""
    out = tmp_path_factory.mktemp("straight") / "sweep"
    with other_threads():
        assert main(sizes_args(stdlib_data, out)) == 0
    assert threads_used(out) == each("l1-d32", "l2-d64", "l3-d96")
    return out


def test_parallel_runs_are_separate_processes_with_the_same_numbers(
    straight, stdlib_data, tmp_path, run_cli, monkeypatch
):
    """--parallel-runs 2: each run a `pretrainer train` process of its own, two at once, with the
    sweep's thread count whatever OMP_NUM_THREADS and MKL_NUM_THREADS say; every row of the CSV is the
    in-process sweep's."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(OTHER))
    monkeypatch.setenv("MKL_NUM_THREADS", str(OTHER))
    code, out, err = run_cli(
        *sizes_args(stdlib_data, tmp_path, "1x32,2x64"), "--parallel-runs", "2", "--train.device=cpu"
    )
    assert code == 0, err
    assert f"not OMP_NUM_THREADS={OTHER} and MKL_NUM_THREADS={OTHER}" in out
    assert threads_used(tmp_path) == each("l1-d32", "l2-d64")
    assert strip(read_csv(tmp_path / "sweep.csv")) == strip(read_csv(straight / "sweep.csv"))[:2]


def strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]


def test_interrupted_sweep_resumes_without_redoing_runs_and_equals_an_uninterrupted_one(
    straight, stdlib_data, tmp_path, run_cli
):
    """SIGTERM mid-run, the same command again: the same CSV as the sweep run straight through. The
    stopped part runs in a forked child (one thread, helpers._child), the rest in this process (OTHER
    threads): every run trains with the sweep's count in both, so the resume is bit-exact."""
    args = lambda out: sizes_args(stdlib_data, out)  # noqa: E731

    stopped, log = tmp_path / "stopped", tmp_path / "sweep.log"
    proc = fork_cli(*args(stopped), log=log)  # a process to signal (forked: no interpreter start-up)
    second = stopped / "runs" / "l2-d64" / "metrics.jsonl"
    deadline = time.time() + 120
    # the signal lands early in the second run: its 20 steps take a fast machine ~0.3 s, a check here a
    # few milliseconds
    while time.time() < deadline and proc.is_alive():
        if second.exists() and any(
            '"loss"' in line and json.loads(line)["step"] >= 2 for line in second.read_text().splitlines()
        ):
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(120)
    out = log.read_text()
    assert proc.exitcode == 128 + signal.SIGTERM, out[-2000:]
    assert "same command continues the sweep" in out
    assert [r["run"] for r in read_csv(stopped / "sweep.csv")] == ["l1-d32"]
    assert threads_used(stopped) == each("l1-d32", "l2-d64")  # the child's: its finished and stopped runs
    first_exit = (stopped / "runs" / "l1-d32" / "exit.json").read_text()

    with other_threads():
        code, out, err = run_cli(*args(stopped))
    assert code == 0, err
    assert "1 of 3 runs already finished (l1-d32): kept" in out
    assert RESUMED_ELSEWISE not in out and threads_used(stopped) == each("l1-d32", "l2-d64", "l3-d96")
    assert "resuming from" in out and (stopped / "runs" / "l1-d32" / "exit.json").read_text() == first_exit
    assert strip(read_csv(stopped / "sweep.csv")) == strip(read_csv(straight / "sweep.csv"))
    assert len(read_csv(straight / "sweep.csv")) == 3

    fit = fit_sweep(stopped, resamples=1000)  # one token count: the law it supports, and why
    assert fit["form"] == "n_power" and "same number of tokens" in fit["fallback"]
    assert fit["predictions"][0]["kind"] == "loss" and "no D-term" in fit["no_compute_optimal"]
