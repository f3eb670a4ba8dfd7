"""What a run does on each stop signal: one checkpoint, the signal named, 128 + N, an exact resume."""

import os
import signal
import time

from helpers import losses, tiny_overrides

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics

# each run is signalled once it logs step 3; five forked at once on two cores log a step every ~0.1 s,
# so the 37 steps left leave seconds for the signal to land before the run would finish
STEPS = 40


def test_every_stop_signal_checkpoints_and_stops_and_resumes_bit_exactly(stdlib_data, tmp_path):
    """A scheduler's stop (TERM), a closed terminal (HUP), a SLURM time-limit warning (USR1, USR2) and
    Ctrl-C (INT): each of five runs, forked at once, gets one; each writes one checkpoint, names the
    signal in exit.json, exits 128 + N, and resumes to the losses of a run straight through (all
    forked: the same threads)."""
    import json

    from helpers import exit_hook, exit_hook_calls, fork_train

    settings = {"train.max_steps": STEPS, "ckpt.every": 1000, "eval.every": 0}
    sent = {name: getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT")}
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
            if metrics.exists() and any(r.get("step", 0) >= 3 for r in read_metrics(metrics)):
                os.kill(pending.pop(name).pid, sent[name])
        time.sleep(0.02)
    for name, proc in procs.items():
        proc.join(120)
        log = (tmp_path / f"{name}.log").read_text()
        assert proc.exitcode == 128 + sent[name], log[-2000:]
        assert f"signal {name}: checkpoint written at step" in log, log[-2000:]
        record = json.loads((runs[name] / "exit.json").read_text())
        assert (
            record["reason"] == "signal"
            and name in record["message"]
            and record["exit_code"] == proc.exitcode
        )
        checkpoint = latest_checkpoint(runs[name])
        assert checkpoint is not None and 3 <= int(checkpoint.name.split("-")[1]) < STEPS
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
        assert losses(run) == losses(straight) and len(losses(straight)) == STEPS
        assert exit_hook_calls(tmp_path / f"{run.name}.hook")[1:] == [("finished", 0, STEPS, str(run))]
