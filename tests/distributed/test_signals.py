"""What a run shows while it runs: metrics, mlflow, and what it does on SIGTERM."""

import os
import signal
import subprocess
import sys
import time

from helpers import losses, tiny_overrides

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics


def _train_subprocess(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "pretrainer", "train", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


# interrupted sweep (one process) and test_cluster's launcher test (every worker)
def test_sigterm_checkpoints_and_resume_is_bit_exact(stdlib_data, tmp_path, run_cli):
    settings = {"train.max_steps": 60, "ckpt.every": 1000, "eval.every": 0}
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = _train_subprocess(tiny_overrides(stdlib_data, stopped, **settings))
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until it is mid-run
        records = read_metrics(stopped / "metrics.jsonl") if (stopped / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= 5 for r in records):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    checkpoint = latest_checkpoint(stopped)
    assert checkpoint is not None and (checkpoint / "COMPLETE").is_file()
    stop_step = int(checkpoint.name.split("-")[1])
    assert 5 <= stop_step < 60 and "signal SIGTERM: checkpoint written at step" in err
    # resume the stopped run and run the other straight through, in this process (its threads are a
    # fresh process's: the same numbers)
    for run in (stopped, straight):
        assert run_cli("train", *tiny_overrides(stdlib_data, run, **settings))[0] == 0
    assert losses(stopped) == losses(straight) and len(losses(straight)) == 60


def test_hup_usr1_usr2_int_checkpoint_and_stop_like_sigterm_and_resume_bit_exactly(stdlib_data, tmp_path):
    """A closed terminal (HUP), a SLURM time-limit warning (USR1, USR2) and Ctrl-C (INT): each of four
    runs, forked at once, gets one; each writes one checkpoint, names the signal in exit.json, exits
    128 + N, and resumes to the losses of a run straight through (all forked: the same threads)."""
    import json

    from helpers import exit_hook, exit_hook_calls, fork_train

    settings = {"train.max_steps": 100, "ckpt.every": 1000, "eval.every": 0}
    sent = {name: getattr(signal, name) for name in ("SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT")}
    runs = {name: tmp_path / name for name in sent}
    hooked = lambda run: {**settings, "run.on_exit": exit_hook(run.parent / f"{run.name}.hook")}  # noqa: E731
    procs = {
        name: fork_train(*tiny_overrides(stdlib_data, run, **hooked(run)), log=tmp_path / f"{name}.log")
        for name, run in runs.items()
    }
    pending, deadline = dict(procs), time.time() + 120
    while pending and time.time() < deadline:
        for name in list(pending):
            metrics = runs[name] / "metrics.jsonl"
            if metrics.exists() and any(r.get("step", 0) >= 5 for r in read_metrics(metrics)):
                os.kill(pending.pop(name).pid, sent[name])
        time.sleep(0.02)
    for name, proc in procs.items():
        proc.join(120)
        log = (tmp_path / f"{name}.log").read_text()
        assert proc.exitcode == 128 + sent[name], log[-2000:]
        record = json.loads((runs[name] / "exit.json").read_text())
        assert (
            record["reason"] == "signal"
            and name in record["message"]
            and record["exit_code"] == proc.exitcode
        )
        checkpoint = latest_checkpoint(runs[name])
        assert checkpoint is not None and 5 <= int(checkpoint.name.split("-")[1]) < 100
        # run.on_exit: once, after the checkpoint, with the signal's reason and code
        assert exit_hook_calls(tmp_path / f"{name}.hook") == [
            ("signal", proc.exitcode, record["step"], str(runs[name]))
        ]
    straight = tmp_path / "straight"
    resumed = [
        fork_train(*tiny_overrides(stdlib_data, run, **hooked(run)), log=tmp_path / "resume.log")
        for run in [*runs.values(), straight]
    ]
    for proc in resumed:
        proc.join(120)
        assert proc.exitcode == 0, (tmp_path / "resume.log").read_text()[-2000:]
    for run in runs.values():
        assert losses(run) == losses(straight) and len(losses(straight)) == 100
        assert exit_hook_calls(tmp_path / f"{run.name}.hook")[1:] == [("finished", 0, 100, str(run))]
