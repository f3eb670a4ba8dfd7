import csv
import json

import pytest
from safetensors.torch import load_file

from conftest import tiny_config
from pretrainer.metrics import read_metrics
from pretrainer.train.checkpoint import latest_checkpoint
from pretrainer.train.loop import train


@pytest.fixture(scope="module")
def finished_run(stdlib_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 20, "eval.every": 10, "mlflow.enabled": True,
                                           "budget.usd_per_gpu_hour": 2.0}))
    return run


def test_export_writes_the_x1_report(finished_run, tmp_path, run_cli):
    out = tmp_path / "report"
    code, stdout, err = run_cli("export", finished_run, "--out", out)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {"manifest.json", "metrics.csv", "loss-curve.png", "gradnorm-curve.png",
                                               "throughput.png", "final.safetensors", "mlflow-run-uri.txt"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 1337 and manifest["steps"] == 20 and manifest["tokens"] == 20 * 8 * 64
    assert set(manifest["versions"]) >= {"python", "torch", "numpy", "tiktoken", "safetensors", "mlflow"}
    assert manifest["hardware"]["device_type"] == "cpu" and manifest["hardware"]["cpu_model"]
    records = read_metrics(finished_run / "metrics.jsonl")
    assert manifest["final_train_loss"] == [r["loss"] for r in records if "loss" in r][-1]
    assert manifest["final_val_loss"] == [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert manifest["spent_usd"] == pytest.approx(2.0 * manifest["wall_time_s"] / 3600)
    assert manifest["final_weights"]["reload_resave_byte_identical"] is True
    weights = load_file(out / "final.safetensors")
    assert weights.keys() == load_file(latest_checkpoint(finished_run) / "model.safetensors").keys()
    run_id = (finished_run / "mlflow-run-id.txt").read_text().strip()
    assert f"run_id: {run_id}" in (out / "mlflow-run-uri.txt").read_text()


def test_metrics_csv_is_long_format_with_every_number(finished_run, tmp_path, run_cli):
    run_cli("export", finished_run, "--out", tmp_path / "report")
    rows = list(csv.DictReader(open(tmp_path / "report" / "metrics.csv")))
    records = read_metrics(finished_run / "metrics.jsonl")
    expected = sum(1 for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float)))
    assert len(rows) == expected and set(rows[0]) == {"step", "kind", "name", "value"}
    losses = [float(r["value"]) for r in rows if r["name"] == "loss"]
    assert losses == [r["loss"] for r in records if "loss" in r]


def test_plots_are_real_pngs_with_data(finished_run, tmp_path, run_cli):
    import matplotlib.image as mpimg

    import numpy as np

    run_cli("export", finished_run, "--out", tmp_path / "report")
    first_line, second_line = np.array([0x1F, 0x77, 0xB4]) / 255, np.array([0xFF, 0x7F, 0x0E]) / 255  # matplotlib C0, C1
    for name, lines in (("loss-curve.png", 2), ("gradnorm-curve.png", 2), ("throughput.png", 1)):
        image = mpimg.imread(tmp_path / "report" / name)[..., :3]
        assert image.shape[0] > 300 and image.shape[1] > 500
        for colour in (first_line, second_line)[:lines]:  # the data lines are drawn, not just axes
            assert (np.abs(image - colour).max(axis=-1) < 0.05).sum() > 200, name


def test_export_of_a_non_run_is_a_clear_error(tmp_path, run_cli):
    code, _, err = run_cli("export", tmp_path, "--out", tmp_path / "report")
    assert code == 2 and "no complete checkpoint" in err and not (tmp_path / "report").exists()
