"""What a run shows while it runs: metrics, mlflow, and what it does on SIGTERM."""

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
    # resumes the same mlflow run
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 4, "mlflow.enabled": True}))
    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pretrainer").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == (run / "mlflow-run-id.txt").read_text().strip()
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["optim.lr"] == "0.003"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [1, 2, 3, 4]
    assert {m.step for m in client.get_metric_history(runs[0].info.run_id, "val_loss")} == {0, 4}


def test_micro_batch_auto_is_a_clear_error_on_cpu(stdlib_data, tmp_path):
    with pytest.raises(UserError, match="needs train.global_batch"):
        tiny_config(stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto"})
    with pytest.raises(UserError, match="auto searches GPU memory and needs CUDA"):
        train(
            tiny_config(
                stdlib_data, tmp_path / "run", **{"train.micro_batch": "auto", "train.global_batch": 16}
            )
        )


def test_tokens_per_s_after_an_eval_or_a_checkpoint_on_a_non_logging_step_is_not_inflated(
    stdlib_data, tmp_path
):
    """log.every = 10, eval.every = ckpt.every = 15: the interval after step 15's evaluation and
    checkpoint counts the tokens since them over the time since them (it divided the interval's
    tokens by the time after the pause: 2.26x the median)."""
    import statistics

    run = tmp_path / "run"
    cadence = {
        "log.every": 10,
        "eval.every": 15,
        "ckpt.every": 15,
        "eval.batches": 8,
        "train.micro_batch": 32,
    }
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 60, **cadence}))
    rates = [r["tokens_per_s"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r][
        1:
    ]  # after warm-up
    assert max(rates) <= 1.5 * statistics.median(rates), rates
