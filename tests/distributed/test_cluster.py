"""Runs that survive real clusters, under `pretrainer train --nproc 2` (torchrun, 2 gloo ranks on CPU):
signals to every process, the exit code as a contract, damaged checkpoints, kill -9 anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import exit_hook, exit_hook_calls, fork_train, losses, tiny_overrides, train_ranks
from support.cluster_helpers import exit_record

from pretrainer.artifacts.checkpoint import list_checkpoints
from pretrainer.artifacts.metrics import read_metrics

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 32  # signalled once step 10 is logged: 22 steps (~0.6 s alone, more under load) to spare


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


def logged_step(run: Path) -> int:
    """The highest step with a logged loss so far (0: none yet)."""
    records = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return max((r["step"] for r in records if "loss" in r), default=0)


def wait_for_step(run: Path, step: int, proc, timeout: float = 120) -> None:
    """Until the run has logged `step` (proc: a Popen or a forked multiprocessing.Process)."""
    running = proc.is_alive if hasattr(proc, "is_alive") else lambda: proc.poll() is None
    deadline = time.time() + timeout
    while time.time() < deadline and running():
        records = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= step and "loss" in r for r in records):
            return
        time.sleep(0.01)  # a fast machine runs a step of these runs in ~10 ms
    raise AssertionError(f"{run}: step {step} not reached (the process ended: {not running()})")


@pytest.fixture(scope="module")
def straight(stdlib_data, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run to compare with (forked ranks: the launcher is not under test here)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train_ranks(2, *nproc_args(stdlib_data, run)[3:])
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
    # the same arguments resume (as forked ranks: what the launcher adds was checked above)
    train_ranks(2, *nproc_args(stdlib_data, run)[3:])
    assert losses(run) == losses(straight)  # identical floats at every step


def test_usr1_to_the_launcher_reaches_the_workers_past_torchrun_and_resumes_bit_exactly(
    straight, stdlib_data, tmp_path
):
    """SLURM's time-limit warning (--signal=B:USR1@120) goes to the batch script's process, here the
    launcher; torchrun does not handle USR1 (it would die of it), so the launcher sends it to the workers."""
    run = tmp_path / "run"
    proc = start(*nproc_args(stdlib_data, run))
    wait_for_step(run, 10, proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = finish(proc)
    assert code == 128 + signal.SIGUSR1, out[-3000:]
    record = exit_record(run)
    assert record["reason"] == "signal" and "SIGUSR1" in record["message"] and record["step"] < STEPS
    assert [int(c.name.split("-")[1]) for c in list_checkpoints(run)] == [record["step"]]
    train_ranks(2, *nproc_args(stdlib_data, run)[3:])
    assert losses(run) == losses(straight)


def test_hup_and_usr2_under_nproc_checkpoint_once_and_resume_bit_exactly(straight, stdlib_data, tmp_path):
    """Two `--nproc 2` runs at once: HUP to the launcher (its terminal closed), USR2 to the workers only
    (`srun --signal=USR2@N` to a step's processes). Each: one checkpoint at the stop, exit.json names the
    signal, exit 128 + N, and the same arguments resume to the uninterrupted run's losses. (INT to every
    process takes the launcher's path of TERM to every process, above; each signal's handling inside a
    trainer is tests/distributed/test_signals.py's.)"""
    sent = {"SIGHUP": "launcher", "SIGUSR2": "workers"}
    runs = {name: tmp_path / name for name in sent}
    procs = {name: start(*nproc_args(stdlib_data, run)) for name, run in runs.items()}
    # each run is signalled as soon as it logs step 10, both watched at once: waiting for one run
    # after another let a later one reach its last step first under load (it finished, exit 0)
    pending, deadline = dict(procs), time.time() + 120
    while pending and time.time() < deadline:
        for name, proc in list(pending.items()):
            assert proc.poll() is None, f"{name}: the run ended before step 10"
            if logged_step(runs[name]) < 10:
                continue
            tree = process_tree(proc.pid)  # the launcher, torchrun, the workers
            workers = [pid for pid in tree if pid not in (proc.pid, *children_of(proc.pid))]
            targets = {"launcher": [proc.pid], "workers": workers}[sent[name]]
            assert targets, tree
            # one may be gone since the snapshot (under load its parent was signalled first)
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, getattr(signal, name))
            del pending[name]
        time.sleep(0.05)
    assert not pending, f"step 10 not reached in 120 s: {sorted(pending)}"
    for name, proc in procs.items():
        code, out = finish(proc)
        signum = getattr(signal, name)
        assert code == 128 + signum, (name, out[-3000:])
        record = exit_record(runs[name])
        assert record["reason"] == "signal" and name in record["message"] and record["exit_code"] == code
        assert [int(c.name.split("-")[1]) for c in list_checkpoints(runs[name])] == [record["step"]]
        assert record["step"] < STEPS
    for run in runs.values():
        train_ranks(2, *nproc_args(stdlib_data, run)[3:])
        assert losses(run) == losses(straight), run.name


def children_of(pid: int) -> list[int]:
    return [child for child in process_tree(pid) if child != pid and parent_of(child) == pid]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


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


EXIT_CASES = {"budget_stop": (4, "budget_stop"), "hang": (3, "collective_timeout")}


@pytest.fixture(scope="module")
def exit_cases(stdlib_data, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """A budget stop and a hung collective under `--nproc 2`, launched at once (the hang waits out
    its 6 s timeout meanwhile: the timeout bounds the ranks' first rendezvous too, and on a loaded
    machine one rank's start-up ran 3 s behind the other's). (budget_halt, exit 5, takes the same path
    to the launcher: test_budget_runs.py.) -> case: (run dir, exit code, output)."""
    root = tmp_path_factory.mktemp("exits")
    budget = {"budget.cap_usd": 10, "budget.usd_per_gpu_hour": 1.0, "budget.check_every_s": 0.01}
    extra = {
        "budget_stop": {**budget, "budget.file": budget_file(root / "b.json", spent=1, projected=20)},
        "hang": {"parallel.hang_drill_step": 3, "parallel.timeout_s": 6},
    }
    hook = lambda case: {"run.on_exit": exit_hook(root / f"{case}.hook")}  # noqa: E731 (the launcher runs it)
    procs = {
        case: start(*nproc_args(stdlib_data, root / case, **extra[case], **hook(case))) for case in EXIT_CASES
    }
    return {case: (root / case, *finish(proc)) for case, proc in procs.items()}


@pytest.mark.parametrize("case", list(EXIT_CASES))
def test_each_exit_reason_is_the_exit_code_of_nproc(case, exit_cases):
    (run, code, out), (expected_code, expected_reason) = exit_cases[case], EXIT_CASES[case]
    assert code == expected_code, out[-3000:]
    record = exit_record(run)
    assert record["reason"] == expected_reason and record["exit_code"] == expected_code
    assert f"run ended: {expected_reason} (exit {expected_code})" in out
    assert bool(list_checkpoints(run)) == (case == "budget_stop")  # halt and a dead rank write none
    # run.on_exit: once, by the launcher after every worker ended, with the reason and the code
    assert exit_hook_calls(run.parent / f"{case}.hook") == [
        (expected_reason, expected_code, record["step"], str(run))
    ]


# --- kill -9 at random moments: at most 2 x ckpt.every steps lost, metrics.jsonl exact, rest identical ---


def test_kill_9_at_many_random_points_continues_identically(stdlib_data, tmp_path):
    import random

    settings = {
        "train.max_steps": 60,
        "train.micro_batch": 16,
        "ckpt.every": 4,
        "eval.every": 20,
        "mlflow.enabled": False,
    }
    args = lambda run: tiny_overrides(stdlib_data, run, **settings)  # noqa: E731
    straight, killed, log = tmp_path / "straight", tmp_path / "killed", tmp_path / "train.log"
    first = fork_train(*args(straight), log=log)
    first.join(240)
    assert first.exitcode == 0, log.read_text()[-2000:]
    rng = random.Random(0)
    # three kills, each once the run is past a random step; 20 steps and more to go (a fast machine runs
    # them in a fraction of a second, and the run must still be alive when killed)
    for target in sorted(rng.sample(range(2, 40), 3)):
        child = fork_train(*args(killed), log=log)
        wait_for_step(killed, target, child)
        time.sleep(rng.uniform(0.0, 0.05))  # then mid-step, mid-checkpoint, mid-metrics write, ...
        assert child.is_alive(), log.read_text()[-2000:]
        logged = max(losses(killed), default=0)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        resumed = max((int(c.name.split("-")[1]) for c in list_checkpoints(killed)), default=0)
        # lost: at most ckpt.every steps, plus those trained while the newest periodic checkpoint was still
        # being written in the background (finished before the next one starts): 2 x ckpt.every at most
        assert logged - resumed <= 2 * settings["ckpt.every"], (logged, resumed)
    last = fork_train(*args(killed), log=log)  # the same command, once more, to the end
    last.join(240)
    assert last.exitcode == 0, log.read_text()[-2000:]
    records = read_metrics(killed / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 61))  # no duplicated or missing rows
    assert [r["step"] for r in records if "val_loss" in r] == [0, 20, 40, 60]
    assert losses(killed) == losses(straight)  # identical floats at every step
    final = lambda r: (r / "checkpoints" / "step-0000060" / "model.safetensors").read_bytes()  # noqa: E731
    assert final(killed) == final(straight)
