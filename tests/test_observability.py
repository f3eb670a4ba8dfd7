"""What a run shows while it runs: metrics, mlflow, and what it does on SIGTERM."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import tiny_config, tiny_overrides

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.errors import UserError
from pretrainer.train.loop import train


def test_logged_steps_carry_norms_and_update_ratio(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 6, "budget.usd_per_gpu_hour": 3.6}))
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    for r in records:
        assert r["param_norm"] > 0 and 0 < r["update_to_param"] < 0.1
        assert r["spent_usd"] == pytest.approx(3.6 * r["elapsed_s"] / 3600)
        assert "mfu" not in r  # no trusted peak for a CPU: MFU is not reported rather than guessed


def test_mlflow_store_in_the_run_dir_lists_the_run_and_its_metrics(stdlib_data, tmp_path, capfd):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    train(
        tiny_config(
            stdlib_data, run, **{"train.max_steps": 4, "train.stop_at_step": 2, "mlflow.enabled": True}
        )
    )
    out, err = capfd.readouterr()  # mlflow's INFO lines (creating its database) stay out of the run's output
    assert "INFO" not in out + err and "step 2/2 | loss" in out
    train(
        tiny_config(stdlib_data, run, **{"train.max_steps": 4, "mlflow.enabled": True})
    )  # resumes the same mlflow run
    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pretrainer").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == (run / "mlflow-run-id.txt").read_text().strip()
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["optim.lr"] == "0.003"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [1, 2, 3, 4]
    assert {m.step for m in client.get_metric_history(runs[0].info.run_id, "val_loss")} == {0, 4}


def _train_subprocess(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "pretrainer", "train", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


# `make test-all`; SIGTERM -> 128+15 and a resume equal to the straight run are in test_scaling's
@pytest.mark.slow
# interrupted sweep (one process) and test_cluster's launcher test (every worker)
def test_sigterm_checkpoints_and_resume_is_bit_exact(stdlib_data, tmp_path):
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
    # resume the stopped run and run the other straight through, at the same time
    procs = [_train_subprocess(tiny_overrides(stdlib_data, run, **settings)) for run in (stopped, straight)]
    assert [proc.wait(timeout=300) for proc in procs] == [0, 0]
    losses = lambda run: {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert losses(stopped) == losses(straight) and len(losses(straight)) == 60


def test_micro_batch_auto_is_a_clear_error_on_cpu(stdlib_data, tmp_path):
    with pytest.raises(UserError, match="needs train.global_batch"):
        tiny_config(stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto"})
    with pytest.raises(UserError, match="auto searches GPU memory and needs CUDA"):
        train(
            tiny_config(
                stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto", "train.global_batch": 16}
            )
        )
