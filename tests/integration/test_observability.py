"""What a run shows while it runs: metrics, the trackers, and what it does on SIGTERM."""

import pytest
from helpers import tiny_config

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


def test_every_tracker_holds_each_step_once_across_a_stop_a_lost_checkpoint_and_a_resume(
    stdlib_data, tmp_path, capfd, monkeypatch
):
    """mlflow, TensorBoard and W&B (offline), read back with their own readers. The first launch logs
    steps 1-6 and checkpoints at 4 and 6; step 6's checkpoint is then lost (as when a run is killed after
    logging past its last checkpoint), so the resume recomputes steps 5-6: TensorBoard purges and takes
    them again, mlflow and W&B are not sent them twice. The same run in each, the same values."""
    import shutil

    from mlflow.tracking import MlflowClient
    from support.tracker_readers import mlflow_history, tensorboard_history, wandb_history, wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    settings = {
        "train.max_steps": 10,
        "ckpt.every": 4,
        "eval.every": 4,
        "track.backends": "mlflow,tensorboard,wandb",
    }
    train(tiny_config(stdlib_data, run, **settings, **{"train.stop_at_step": 6}))
    out, err = capfd.readouterr()  # the trackers' own lines (mlflow creating its database) stay out
    assert (
        "INFO" not in out + err
        and "wandb:" not in out + err
        and "warning: " not in out.replace("warning: the spike detector", "")
    ), out + err
    shutil.rmtree(run / "checkpoints" / "step-0000006")
    train(tiny_config(stdlib_data, run, **settings))
    records = read_metrics(run / "metrics.jsonl")
    loss = {r["step"]: r["loss"] for r in records if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert list(loss) == list(range(1, 11)) and list(val) == [0, 4, 8, 10]
    for history in (mlflow_history, wandb_history):
        assert history(run, "loss") == {step: [value] for step, value in loss.items()}, history
        assert history(run, "val_loss") == {step: [value] for step, value in val.items()}, history
    for key, expected in (("loss", loss), ("val_loss", val)):  # float32 in event files
        held = tensorboard_history(run, key)
        assert list(held) == list(expected) and all(len(v) == 1 for v in held.values())
        assert [v[0] for v in held.values()] == pytest.approx(list(expected.values()), rel=1e-6)

    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pretrainer").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == (run / "mlflow-run-id.txt").read_text().strip()
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["optim.lr"] == "0.003"
    run_id = (run / "wandb-run-id.txt").read_text().strip()
    launches = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    first = [r.run.config for r in wandb_records(launches[0]) if r.WhichOneof("record_type") == "run"]
    assert len(launches) == 2 and any(
        item.key == "optim.lr" and item.value_json == "0.003" for c in first for item in c.update
    )


def test_micro_batch_auto_is_a_clear_error_on_cpu(stdlib_data, tmp_path):
    with pytest.raises(UserError, match="needs train.global_batch"):
        tiny_config(stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto"})
    with pytest.raises(UserError, match="auto searches GPU memory and needs CUDA"):
        train(
            tiny_config(
                stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto", "train.global_batch": 16}
            )
        )


@pytest.mark.quiet  # compares the rates of intervals: another test ending mid-run skews them
def test_tokens_per_s_after_an_eval_or_a_checkpoint_on_a_non_logging_step_is_not_inflated(
    stdlib_data, tmp_path
):
    """log.every = 10, eval.every = ckpt.every = 15: the interval after step 15's evaluation and
    checkpoint counts the tokens since them over the time since them (it divided the interval's
    tokens by the time after the pause: 2.26x its neighbours). Each such interval is held against the
    intervals beside it, so a machine whose load changes mid-run (another process) does not fail it."""
    run = tmp_path / "run"
    cadence = {
        "log.every": 10,
        "eval.every": 15,
        "ckpt.every": 15,
        "eval.batches": 8,
        "train.micro_batch": 32,
    }
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 60, **cadence}))
    rates = {r["step"]: r["tokens_per_s"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    for after_pause in (20, 50):  # the intervals holding step 15's and step 45's evaluation and checkpoint
        beside = max(rates[after_pause - 10], rates[after_pause + 10])
        assert rates[after_pause] <= 1.5 * beside, rates


def test_the_profiler_traces_its_window_of_a_real_run(stdlib_data, tmp_path):
    """train.profile_at_step = 3 with 2 steps: one Chrome trace of steps 3-4, holding each step's range
    and the model's matrix products inside it; the run's numbers are those of a run without it."""
    import json

    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    settings = {"train.max_steps": 5, "eval.every": 0, "ckpt.every": 0}
    train(tiny_config(stdlib_data, profiled, **settings, **{"train.profile_at_step": 3}))
    train(tiny_config(stdlib_data, plain, **settings))
    traces = list((profiled / "profile").iterdir())
    assert [t.name for t in traces] == ["trace-steps-3-4-rank0.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("name", "").startswith("step ") and e.get("ph") == "X"}
    assert sorted(steps) == ["step 3", "step 4"]
    window = steps["step 3"]
    inside = {
        e["name"]
        for e in events
        if e.get("ph") == "X" and window["ts"] <= e["ts"] <= window["ts"] + window["dur"]
    }
    assert {
        "aten::mm",
        "aten::scaled_dot_product_attention",
    } & inside and "Optimizer.step#AdamW.step" in inside
    losses = lambda run: [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]  # noqa: E731
    assert losses(profiled) == losses(plain) and not (plain / "profile").exists()
