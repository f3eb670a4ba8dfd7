"""Data in, reports out: real-world input accidents are handled and counted, or rejected
in one line; reports keep divergence visible and never draw a rolled-back run backwards."""

from __future__ import annotations

import csv
import json

import pytest
from helpers import tiny_config
from support.inputs_helpers import manifest

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.errors import UserError


def test_a_rolled_back_run_has_unique_rows_and_plots_forward(stdlib_data, tmp_path):
    from pretrainer.analysis.report.export import write_metrics_csv
    from pretrainer.analysis.report.plots import metric_series
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(
        tiny_config(
            stdlib_data,
            run,
            **{
                "train.max_steps": 60,
                "train.micro_batch": 16,
                "optim.lr": 1e-2,
                "eval.every": 60,
                "ckpt.every": 10,
                "spike.window": 32,
                "spike.min_values": 16,
                "spike.inject_at_step": 40,
                "spike.action": "rollback",
            },
        )
    )
    records = read_metrics(run / "metrics.jsonl")
    assert any(r.get("rollback") for r in records)
    write_metrics_csv(records, tmp_path / "metrics.csv")
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    final = [(r["step"], r["kind"], r["name"]) for r in rows if r["kind"] in ("step", "eval")]
    assert len(final) == len(set(final))  # one value per step and name on the final trajectory
    assert {r["kind"] for r in rows} == {"step", "eval", "event", "rolled_back"}
    steps, _ = metric_series(records, "loss")
    assert steps == list(range(1, 61))  # not drawn backwards after the rollback


# --- 8: a torn last line of metrics.jsonl (a kill or a full disk) breaks nothing ---


def test_a_torn_last_metrics_line_is_ignored_by_postmortem_export_and_resume(stdlib_data, tmp_path, run_cli):
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 20, "eval.every": 10}))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 3.1, "gra')
    assert run_cli("postmortem", run)[0] == 0
    assert run_cli("export", run, "--out", tmp_path / "report")[0] == 0
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 30, "eval.every": 10}))  # resume past it
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 31))
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not valid JSON in the middle"):
        read_metrics(run / "metrics.jsonl")


def test_state_json_and_the_report_say_which_data_trained_the_model(stdlib_data, tmp_path, run_cli):
    from pretrainer.artifacts.checkpoint import latest_checkpoint
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 5, "eval.every": 0}))
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    data = state["dataset"]
    assert "cursor" in json.dumps(state["data"])  # the data position (a different thing) is still there
    info = manifest(stdlib_data)
    assert data["tokenizer"]["sha256"] == info["tokenizer"]["sha256"]
    assert {k: v["sha256"] for k, v in data["splits"].items()} == {
        k: v["sha256"] for k, v in info["splits"].items()
    }
    assert run_cli("export", run, "--out", tmp_path / "report")[0] == 0
    assert json.loads((tmp_path / "report" / "manifest.json").read_text())["dataset"] == data
