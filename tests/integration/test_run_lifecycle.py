"""How a run ends when nobody is watching: a wall-clock limit (train.max_hours, a SLURM job's end)
checkpoints and exits 8, and run.on_exit runs once for every way of ending, after the exit record."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from helpers import exit_hook, exit_hook_calls, losses, tiny_config

from pretrainer.artifacts.checkpoint import list_checkpoints
from pretrainer.core.errors import EXIT_TIME_LIMIT, RunStopped, UserError
from pretrainer.train.loop import train


def test_max_hours_stops_with_a_checkpoint_and_the_run_continues_exactly(stdlib_data, tmp_path):
    """A limit of 2 s over all launches (start-up included), and a 2.5 s pause before step 10 (the stall
    drill): the run stops itself by then (exit 8, a checkpoint at the stop; on a loaded machine it may
    come a few steps earlier), and a later launch without the limit continues to the losses of a run
    straight through."""
    run, hook = tmp_path / "run", tmp_path / "hook"
    settings = {"train.max_steps": 60, "ckpt.every": 1000, "eval.every": 0, "log.every": 10}
    limit = {"train.max_hours": 2 / 3600, "alerts.stall_drill_step": 10, "alerts.stall_drill_s": 2.5}
    cfg = tiny_config(stdlib_data, run, **settings, **limit)
    cfg.run.on_exit = exit_hook(hook)
    with pytest.raises(RunStopped) as stopped:
        train(cfg)
    record = json.loads((run / "exit.json").read_text())
    assert stopped.value.exit_code == EXIT_TIME_LIMIT == record["exit_code"] == 8
    assert record["reason"] == "time_limit" and "train.max_hours = 0.000555556 reached" in record["message"]
    assert 1 <= record["step"] <= 10  # the limit is checked before each step
    assert [int(c.name.split("-")[1]) for c in list_checkpoints(run)] == [record["step"]]
    assert exit_hook_calls(hook) == [("time_limit", 8, record["step"], str(run))]
    train(tiny_config(stdlib_data, run, **settings))  # max_hours is a limit, not the computation: resumable
    straight = tmp_path / "straight"
    train(tiny_config(stdlib_data, straight, **settings))
    assert losses(run) == losses(straight) and max(losses(run)) == 60


def test_near_a_slurm_jobs_end_the_run_stops_and_asks_for_a_requeue(stdlib_data, tmp_path, monkeypatch):
    """Inside a SLURM job whose end comes within run.stop_margin_s after a few steps: checkpoint, exit
    8, and a requeue. Without `scontrol` here the requeue fails, which the record says; the run then
    ended for real, so run.on_exit runs (the real requeue: tests/distributed/test_slurm.py). A job
    that ends within the margin before the first step stops without a requeue (it would loop)."""
    import time

    run, hook = tmp_path / "run", tmp_path / "hook"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 206))  # set-up, some steps, margin
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    settings = {"train.max_steps": 100000, "eval.every": 0, "run.stop_margin_s": 200, "log.every": 100}
    cfg = tiny_config(stdlib_data, run, **settings)
    cfg.run.on_exit = exit_hook(hook)  # echo: /bin/sh's own
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(RunStopped, match="SLURM job 4242 ends at .*stop_margin_s = 200 s"):
            train(cfg)
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # a requeue ignores SLURM's SIGTERM to the old copy
    record = json.loads((run / "exit.json").read_text())
    assert record["reason"] == "time_limit" and record["step"] > 0 and record["requeued"] is False
    assert "scontrol requeue 4242 failed" in record["message"]
    assert exit_hook_calls(hook) == [("time_limit", 8, record["step"], str(run))]
    # the job's end already within the margin at the start: no step, no requeue asked, a warning
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 100))
    with pytest.raises(RunStopped, match="SLURM job 4242") as stopped:
        train(tiny_config(stdlib_data, tmp_path / "short", **settings))
    assert (
        not stopped.value.requeue and json.loads((tmp_path / "short" / "exit.json").read_text())["step"] == 0
    )


def test_on_exit_runs_after_an_error_too(stdlib_data, tmp_path):
    """Damaged data found at launch (after the run dir is taken): exit 2, and the hook still runs."""
    data, run, hook = tmp_path / "data", tmp_path / "run", tmp_path / "hook"
    shutil.copytree(stdlib_data, data)
    shard = next(data.glob("train*.bin"))
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    cfg = tiny_config(data, run, **{"data.verify": "full"})
    cfg.run.on_exit = exit_hook(hook)
    with pytest.raises(UserError, match="differ from the checksum"):
        train(cfg)
    assert [(reason, code) for reason, code, _, _ in exit_hook_calls(hook)] == [("error", 2)]


def test_keep_best_keeps_the_lowest_val_checkpoint_and_verbs_can_pick_it(stdlib_data, tmp_path, run_cli):
    """An LR spike late in the run makes the newest checkpoints worse than an older one: rotation
    (ckpt.keep = 2) keeps that one too, and `export RUN --checkpoint best` reads it."""
    from pretrainer.artifacts.checkpoint import best_checkpoint
    from pretrainer.artifacts.metrics import read_metrics

    run = tmp_path / "run"
    spike = {
        "spike.inject_at_step": 42,
        "spike.inject_kind": "lr",
        "spike.lr_factor": 300,
        "spike.inject_batches": 8,
    }
    settings = {
        "train.max_steps": 60,
        "eval.every": 10,
        "ckpt.every": 10,
        "ckpt.keep": 2,
        "ckpt.keep_best": True,
    }
    train(tiny_config(stdlib_data, run, **settings, **spike))
    vals = {r["step"]: r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r}
    best_step = min((step for step in vals if step), key=vals.get)
    assert best_step < 50, vals  # the spike made the newest two worse
    kept = [int(c.name.split("-")[1]) for c in list_checkpoints(run)]
    assert kept == [best_step, 50, 60] and best_checkpoint(run).name == f"step-{best_step:07d}"
    code, out, _ = run_cli(
        "export", run, "--checkpoint", "best", "--format", "safetensors", "--out", tmp_path / "b"
    )
    assert code == 0 and f"(step {best_step})" in out, out
    code, _, err = run_cli("export", tmp_path / "straight-missing", "--checkpoint", "best")
    assert code == 2 and err.startswith("error: ")


def test_a_bare_interrupt_still_ends_the_run_in_order(stdlib_data, tmp_path):
    """A second Ctrl-C raises KeyboardInterrupt with no message: the run's end still writes exit.json,
    runs the hook once, restores the console and releases the run dir's lock."""
    import sys

    import torch

    from pretrainer.artifacts.run_lock import RunDirLock
    from pretrainer.train.console import Console
    from pretrainer.train.distributed import DistEnv
    from pretrainer.train.trainer import end_run

    run, hook = tmp_path / "run", tmp_path / "hook"
    cfg = tiny_config(stdlib_data, run)
    cfg.run.on_exit = exit_hook(hook)
    run.mkdir()  # a run dir that exists (one the lock made is removed again when nothing was written)
    lock = RunDirLock(run)
    lock.acquire()
    streams, console = (sys.stdout, sys.stderr), Console()
    end_run(
        run,
        cfg.run,
        lock,
        DistEnv(0, 1, 0, torch.device("cpu"), None),
        KeyboardInterrupt(),
        step=5,
        run_log=None,
        console=console,
    )
    assert json.loads((run / "exit.json").read_text())["exit_code"] == 130
    assert exit_hook_calls(hook) == [("signal", 130, 5, str(run))]
    assert (sys.stdout, sys.stderr) == streams and not lock.held
    RunDirLock(run).acquire()  # free again


def test_a_failure_while_the_components_are_built_still_alerts_closes_and_restores_the_handlers(
    stdlib_data, tmp_path, monkeypatch
):
    """A component whose build fails (here the console's, after alerts, stopping and spikes are built):
    the run still ends with its last alert ("died") in metrics.jsonl, exit.json, and the process's
    own signal handlers back in place, whatever the components' closing does."""
    from pretrainer.artifacts.metrics import read_metrics
    from pretrainer.train import components

    def failing(trainer):
        raise RuntimeError("the console could not be built")

    monkeypatch.setitem(components.REGISTRY, "console", failing)
    before = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="could not be built"):
        train(tiny_config(stdlib_data, run))
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["alert"], r["message"]) for r in records if "alert" in r] == [
        ("died", "error (exit 1): the console could not be built")
    ]
    assert json.loads((run / "exit.json").read_text())["exit_code"] == 1
    assert signal.getsignal(signal.SIGTERM) is before
