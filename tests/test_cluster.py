"""Runs that survive real clusters, under `pretrainer train --nproc 2` (torchrun, 2 gloo ranks on CPU):
signals to every process, the exit code as a contract, damaged checkpoints, kill -9 anywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_overrides

from pretrainer.artifacts.checkpoint import list_checkpoints
from pretrainer.artifacts.metrics import read_metrics

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 60


def nproc_args(data: Path, run: Path, **extra) -> list[str]:
    settings = {
        "train.max_steps": STEPS,
        "train.micro_batch": 4,
        "eval.every": 0,
        "ckpt.every": 1000,
        "mlflow.enabled": False,
        **extra,
    }
    return ["train", "--nproc", "2", *tiny_overrides(data, run, **settings)]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pretrainer", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: int = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc): the launcher, torchrun and every worker."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        records = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= step and "loss" in r for r in records):
            return
        time.sleep(0.05)
    raise AssertionError(f"{run}: step {step} not reached (process exited {proc.poll()})")


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())


@pytest.fixture(scope="module")
def straight(stdlib_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    code, out = finish(start(*nproc_args(stdlib_data, run)))
    assert code == 0, out[-3000:]
    assert "x 2 ranks" in out and "run ended: finished (exit 0)" in out
    assert exit_record(run)["reason"] == "finished" and len(losses(run)) == STEPS
    return run


def test_sigterm_to_launcher_and_every_worker_checkpoints_once_and_resumes_bit_exactly(
    straight, stdlib_data, tmp_path
):
    # the first round is what a single scancel does; the second checks a repeated signal changes nothing
    repeats = 2
    run = tmp_path / "run"
    proc = start(*nproc_args(stdlib_data, run))
    wait_for_step(run, 10, proc)
    tree = process_tree(proc.pid)
    assert len(tree) >= 4, tree  # the launcher, torchrun, two workers
    for _ in range(repeats):  # as scancel or pkill do: every process at once, maybe more than once
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    record = exit_record(run)
    checkpoints = list_checkpoints(run)
    assert record["reason"] == "signal" and record["exit_code"] == 143
    assert len(checkpoints) == 1 and record["checkpoint"] == str(checkpoints[0]) and record["step"] < STEPS
    assert int(checkpoints[0].name.split("-")[1]) == record["step"]
    code, out = finish(start(*nproc_args(stdlib_data, run)))  # the same command resumes
    assert code == 0, out[-3000:]
    assert losses(run) == losses(straight)  # identical floats at every step


def budget_file(path: Path, spent: float, projected: float) -> Path:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(
        json.dumps(
            {
                "spent_usd": spent,
                "rate_usd_per_hr": 1.0,
                "hours_elapsed": 1.0,
                "projected_total_usd": projected,
                "last_update_utc": now,
            }
        )
    )
    return path


@pytest.mark.parametrize(
    "case, expected_code, expected_reason",
    [
        (
            "budget_stop",
            4,
            "budget_stop",
        ),  # (budget_halt, exit 5, takes the same path to the launcher: test_budget.py)
        ("hang", 3, "collective_timeout"),
    ],
)
def test_each_exit_reason_is_the_exit_code_of_nproc(
    case, expected_code, expected_reason, stdlib_data, tmp_path
):
    run = tmp_path / "run"
    budget = {"budget.cap_usd": 10, "budget.usd_per_gpu_hour": 1.0, "budget.check_every_s": 0.01}
    if case == "hang":
        extra = {"parallel.hang_drill_step": 3, "parallel.timeout_s": 3}
    else:
        extra = {
            **budget,
            "budget.file": budget_file(
                tmp_path / "b.json", spent=1 if case == "budget_stop" else 11, projected=20
            ),
        }
    code, out = finish(start(*nproc_args(stdlib_data, run, **extra)))
    assert code == expected_code, out[-3000:]
    record = exit_record(run)
    assert record["reason"] == expected_reason and record["exit_code"] == expected_code
    assert f"run ended: {expected_reason} (exit {expected_code})" in out
    assert bool(list_checkpoints(run)) == (case == "budget_stop")  # halt and a dead rank write none


# --- damaged checkpoints: fall back to the newest intact one, continue identically ---


def damage(checkpoint: Path, kind: str) -> None:
    weights, optimizer = checkpoint / "model.safetensors", checkpoint / "optimizer.pt"
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "bit flip in weights":
        data = bytearray(weights.read_bytes())
        data[len(data) * 3 // 4] ^= 0x10
        weights.write_bytes(bytes(data))
    elif kind == "truncated optimizer":
        optimizer.write_bytes(optimizer.read_bytes()[:100])
    elif kind == "missing state":
        (checkpoint / "state.json").unlink()
    elif kind == "garbage marker":
        (checkpoint / "COMPLETE").write_text("{not json")


def short_run(data: Path, run: Path, **extra):
    from conftest import tiny_config

    return tiny_config(data, run, **{"train.max_steps": 30, "ckpt.every": 10, "eval.every": 0, **extra})


@pytest.fixture(scope="module")
def straight_30(stdlib_data, tmp_path_factory) -> Path:
    from pretrainer.train.loop import train

    run = tmp_path_factory.mktemp("straight30") / "run"
    train(short_run(stdlib_data, run))
    return run


@pytest.mark.parametrize(
    "kind",
    ["truncated weights", "bit flip in weights", "truncated optimizer", "missing state", "garbage marker"],
)
def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(
    kind, straight_30, stdlib_data, tmp_path, capsys
):
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(short_run(stdlib_data, run, **{"train.stop_at_step": 20}))
    damage(run / "checkpoints" / "step-0000020", kind)
    capsys.readouterr()
    train(short_run(stdlib_data, run))
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "damaged checkpoint" in line]
    assert len(warnings) == 1 and "step-0000020" in warnings[0], out[-2000:]
    assert "resuming from" in out and "step-0000010 at step 10" in out
    assert losses(run) == losses(straight_30)  # steps 11-30 recomputed from step 10, identically
    final = lambda r: (r / "checkpoints" / "step-0000030" / "model.safetensors").read_bytes()  # noqa: E731
    assert final(run) == final(straight_30)


def test_no_intact_checkpoint_is_one_line_and_exit_2(stdlib_data, tmp_path, run_cli):
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(short_run(stdlib_data, run, **{"train.stop_at_step": 20}))
    for checkpoint in list_checkpoints(run):
        damage(checkpoint, "truncated weights")
    code, out, err = run_cli(
        "train", *tiny_overrides(stdlib_data, run, **{"train.max_steps": 30, "ckpt.every": 10})
    )
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "none of the 2 checkpoints is intact" in errors[0]
    assert exit_record(run)["reason"] == "error" and exit_record(run)["exit_code"] == 2


# --- kill -9 at random moments: at most ckpt.every steps lost, metrics.jsonl exact, continuation identical
# ---


# `make test-all` (45 s); the SIGTERM tests check the checkpoint-and-resume path in `make test`
@pytest.mark.slow
def test_kill_9_at_many_random_points_continues_identically(stdlib_data, tmp_path):
    import random

    settings = {
        "train.max_steps": 60,
        "train.micro_batch": 16,
        "ckpt.every": 4,
        "eval.every": 20,
        "mlflow.enabled": False,
    }
    args = lambda run: ["train", *tiny_overrides(stdlib_data, run, **settings)]  # noqa: E731
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, out = finish(start(*args(straight)))
    assert code == 0, out[-2000:]
    rng = random.Random(0)
    for target in sorted(rng.sample(range(2, 54), 3)):  # three kills, each once the run is past a random step
        proc = start(*args(killed))
        wait_for_step(killed, target, proc)
        time.sleep(rng.uniform(0.0, 0.05))  # then mid-step, mid-checkpoint, mid-metrics write, ...
        assert proc.poll() is None, finish(proc)[1][-2000:]
        logged = max(losses(killed), default=0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        resumed = max((int(c.name.split("-")[1]) for c in list_checkpoints(killed)), default=0)
        assert logged - resumed <= settings["ckpt.every"], (logged, resumed)  # lost at most ckpt.every steps
    code, out = finish(start(*args(killed)))  # the same command, once more, to the end
    assert code == 0, out[-2000:]
    records = read_metrics(killed / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 61))  # no duplicated or missing rows
    assert [r["step"] for r in records if "val_loss" in r] == [0, 20, 40, 60]
    assert losses(killed) == losses(straight)  # identical floats at every step
    final = lambda r: (r / "checkpoints" / "step-0000060" / "model.safetensors").read_bytes()  # noqa: E731
    assert final(killed) == final(straight)
