"""Scaling laws: the fit recovers published laws, refuses what data cannot determine, and a CPU
sweep runs end to end, resumes after SIGTERM and feeds `plan --fit`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_overrides
from support.scaling_helpers import read_csv, sweep_args

from pretrainer.analysis.scaling import fit as F


def test_cpu_sweep_then_fit_writes_csv_plots_and_a_prediction_with_an_interval(
    stdlib_data, tmp_path, run_cli
):
    sweep = tmp_path / "sweep"
    # validation at the start and the end, one checkpoint per run
    # this process's thread count, not the default 1: the sweep runs in the test's own process, which has
    # the machine's cores to itself (1 per worker under `make test`'s pytest-xdist: more would oversubscribe)
    quick = ("--eval.every=0", "--ckpt.every=0", f"--sweep.cpu_threads={torch.get_num_threads()}")
    code, out, err = run_cli(*sweep_args(stdlib_data, sweep, "15k,100k,300k", "5120,10240,20480"), *quick)
    assert code == 0, err
    assert "l1-d32-t5.12e03" in out and "15,456" in out  # the plan names the shapes and their exact counts
    # each run's closing lines point at the sweep's own next step, not nine next: blocks of their own
    said = f"next: the sweep goes on; once it ends, pretrainer fit {sweep}"
    assert out.count("next:\n") == 1 and out.count(said) == 9  # the sweep's own next:, once
    rows = read_csv(sweep / "sweep.csv")
    assert len(rows) == 9 and {r["n_layer"] for r in rows} == {"1", "2", "3"}
    assert {int(r["tokens"]) for r in rows} == {5120, 10240, 20480}
    for r in rows:  # each run is a normal run dir that finished its planned steps
        assert json.loads((sweep / "runs" / r["run"] / "exit.json").read_text())["reason"] == "finished"
        assert float(r["flops"]) == pytest.approx(float(r["tokens"]) * float(r["flops"]) / float(r["tokens"]))
    lrs = {r["n_layer"]: float(r["lr"]) for r in rows}
    assert lrs["1"] > lrs["2"] > lrs["3"]  # the power rule: smaller models train at higher learning rates

    # 200 bootstrap resamples (1,000 by default): the intervals' machinery end to end, at a third of its
    # time on these runs (whose law is weakly determined); test_scaling_fit checks the intervals' coverage
    code, out, err = run_cli(
        "fit", sweep, "--predict-params", "1e9", "--predict-compute", "1e18", "--resamples", "200"
    )
    assert code == 0, err
    fit = json.loads((sweep / "fit.json").read_text())
    assert fit["form"] == "nd" and fit["bootstrap"]["used"] >= 0.85 * 200  # degenerate resamples are left out
    for name in ("scaling.png", "residuals.png", "fit.md"):
        assert (sweep / name).stat().st_size > 0
    optimal = fit["predictions"][0]
    assert optimal["kind"] == "optimal_for_params" and optimal["params"] == 1e9
    assert optimal["tokens"]["low"] <= optimal["tokens"]["value"] <= optimal["tokens"]["high"]
    assert "compute-optimal at" in out and "90% interval" in out

    # plan --fit: the loss the planned run should reach, under the same law
    code, out, err = run_cli(
        "plan",
        *[o for o in tiny_overrides(stdlib_data, tmp_path / "r") if "run.dir" not in o],
        "--fit",
        sweep / "fit.json",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    predicted = plan["predicted_loss"]
    expected = F.predict_loss(fit["law"], plan["params_total"], plan["tokens_trained"])
    assert predicted["loss"]["value"] == pytest.approx(float(expected))
    assert predicted["loss"]["low"] <= predicted["loss"]["value"] <= predicted["loss"]["high"]
