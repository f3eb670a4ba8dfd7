"""The $ guard: fake clock, fake budget.json, the training loop's response, and a property test."""

import json
from pathlib import Path

import pytest
from helpers import exit_hook, exit_hook_calls, tiny_config, tiny_overrides
from support.budget_helpers import T0, FakeClock, budget_file

from pretrainer.artifacts.checkpoint import latest_checkpoint, list_checkpoints
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.schema import BudgetConfig
from pretrainer.core.errors import RunStopped
from pretrainer.train.budget import EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT, BudgetGuard
from pretrainer.train.loop import train


def guarded(stdlib_data, run, budget: Path | None, **extra):
    settings_ = {
        "budget.cap_usd": 35,
        "budget.warn_usd": 30,
        "budget.usd_per_gpu_hour": 1.1,
        "budget.check_every_s": 5,
        "train.max_steps": 12,
        "eval.every": 0,
        **extra,
    }
    if budget is not None:
        settings_["budget.file"] = budget
    return tiny_config(stdlib_data, run, **settings_)


def test_warn_is_logged_once_and_the_run_continues(stdlib_data, tmp_path):
    run, hook = tmp_path / "run", tmp_path / "hook.log"
    cfg = guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=31, projected=34))
    cfg.run.on_exit = exit_hook(hook)
    result = train(cfg, clock=FakeClock())
    assert result["step"] == 12
    warnings = [r for r in read_metrics(run / "metrics.jsonl") if "budget_warn" in r]
    assert len(warnings) == 1 and warnings[0]["spent_usd"] == 31
    assert exit_hook_calls(hook) == [("finished", 0, 12, str(run))]  # run.on_exit: once, at the end


def test_projected_over_cap_checkpoints_then_exits(stdlib_data, tmp_path):
    run, hook = tmp_path / "run", tmp_path / "hook.log"
    cfg = guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=20, projected=36))
    cfg.run.on_exit = exit_hook(hook)
    with pytest.raises(RunStopped) as stopped:
        train(cfg, clock=FakeClock())
    assert stopped.value.exit_code == EXIT_BUDGET_PROJECTED == 4
    assert latest_checkpoint(run).name == "step-0000001"  # first check is due at the first step
    assert any("budget_stop" in r for r in read_metrics(run / "metrics.jsonl"))
    assert exit_hook_calls(hook) == [("budget_stop", 4, 1, str(run))]  # after the checkpoint and exit.json


def test_spent_over_cap_exits_at_once_without_a_checkpoint(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 12, "train.stop_at_step": 10, "eval.every": 0}))
    assert [p.name for p in list_checkpoints(run)] == ["step-0000010"]
    cfg = guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=35.5, projected=40))
    cfg.run.on_exit = exit_hook(tmp_path / "hook.log")
    with pytest.raises(RunStopped) as stopped:
        train(cfg, clock=FakeClock())
    assert stopped.value.exit_code == EXIT_BUDGET_SPENT == 5
    assert [p.name for p in list_checkpoints(run)] == ["step-0000010"]  # nothing new written
    assert exit_hook_calls(tmp_path / "hook.log") == [
        ("budget_halt", 5, 11, str(run))
    ]  # halted after step 11


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "missing"),
        ("{not json", "malformed"),
        (json.dumps({"spent_usd": 1}), "malformed (missing rate_usd_per_hr"),
        ("stale", "stale (last update"),
    ],
)
def test_missing_stale_or_malformed_file_falls_back_to_the_estimate(stdlib_data, tmp_path, content, problem):
    path = tmp_path / "b.json"
    if content == "stale":
        budget_file(path, spent=100, projected=100, updated=T0 - 3600)  # would halt, were it believed
    elif content is not None:
        path.write_text(content)
    run = tmp_path / "run"
    guard = BudgetGuard(
        BudgetConfig(cap_usd=35, usd_per_gpu_hour=1.1, file=str(path), stale_after_s=900),
        gpus=1,
        clock=FakeClock(),
    )
    decision = guard.check(elapsed_s=3600, remaining_s=3600)
    assert decision.reading.source == "estimate" and problem in decision.reading.problem
    assert decision.reading.spent_usd == pytest.approx(
        1.1
    ) and decision.reading.projected_total_usd == pytest.approx(2.2)
    result = train(guarded(stdlib_data, run, path), clock=FakeClock())  # the run is not crashed by a bad file
    assert result["step"] == 12 and any("budget_problem" in r for r in read_metrics(run / "metrics.jsonl"))


def test_launch_is_refused_when_the_plan_exceeds_the_cap(stdlib_data, tmp_path, run_cli):
    overrides = tiny_overrides(
        stdlib_data,
        tmp_path / "run",
        **{
            "budget.cap_usd": 1,
            "budget.usd_per_gpu_hour": 100,
            "budget.peak_tflops": 1e-6,
            "train.max_steps": 10,
        },
    )
    code, _, err = run_cli("train", *overrides)
    assert code == 2 and "over budget.cap_usd $1.00" in err and "--budget.allow_over_cap=true" in err
    assert not (tmp_path / "run").exists()
    code, out, err = run_cli("train", *overrides, "--budget.allow_over_cap=true")
    # allowed; the guard's own estimate (measured step time) is tiny
    assert code == 0 and "budget: projected $" in out
    # resumed for 10 more steps: the launch check times them with the run's own measured step time, not the
    # assumed MFU of a 1e-6 TFLOP/s device that refused it above, and lets it start
    code, out, err = run_cli("train", *overrides, "--train.max_steps=20")
    assert code == 0 and "s per step (measured by this run)" in out, err


def test_a_slow_first_step_is_not_projected_onto_every_step(stdlib_data, tmp_path):
    """A run under a cap it can afford ($1 per second, cap $50; the whole run takes seconds) whose
    first step is slow (1 s: what compile and CUDA start-up make of it on a GPU; here the stall drill's
    pause): that step, start-up and step 0's validation are not taken as the step time (the projection,
    99 x 1 s x $1, stopped it at step 1, exit 4). Not train.compile itself: compiled graphs cached in
    this process would change what other tests see compile."""
    run = tmp_path / "run"
    capped = {"budget.cap_usd": 50, "budget.usd_per_gpu_hour": 3600, "budget.check_every_s": 0.01}
    slow_first = {"alerts.stall_drill_step": 1, "alerts.stall_drill_s": 1.0}
    result = train(tiny_config(stdlib_data, run, **{"train.max_steps": 100, **capped, **slow_first}))
    assert result["step"] == 100
    assert not [r for r in read_metrics(run / "metrics.jsonl") if "budget_stop" in r]


@pytest.mark.quiet  # compares wall-clock times
def test_plan_measures_a_probe_and_a_finished_run_and_predicts_the_real_run(
    stdlib_data, tmp_path, run_cli, monkeypatch
):
    """plan --measure trains a short probe of the config on this machine (its own process) and predicts
    the whole run: within 35% of a real run's wall time, evaluations and checkpoints included, and within
    25% of its peak memory (the process's peak RSS on CPU); both labelled measured. plan --from-run on
    the real run reproduces its wall time within 10%. (35%: a probe of this size measures its step time
    0.055-0.072 s in three runs on a quiet 2-core machine, itself a 30% spread; over minutes the error
    is a few percent, docs/benchmarks.md)"""
    from pretrainer.analysis.calibration import run_measuring_peak_rss

    monkeypatch.setenv(
        "OMP_NUM_THREADS", "1"
    )  # both processes alike, and less at the mercy of a busy machine
    settings = {"train.max_steps": 45, "eval.every": 15, "ckpt.every": 15, "log.every": 5, "eval.batches": 8}
    settings.update({"model.d_model": 128, "train.micro_batch": 16})  # steps, not start-up, make the time
    args = [str(a) for a in tiny_overrides(stdlib_data, tmp_path / "run", **settings)]
    code, out, err = run_cli("plan", *args, "--measure", "--measure-steps", "20", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["time_source"] == "measured" and plan["measured"]["run_steps"] == 20
    assert plan["provenance"]["wall_hours"] == plan["provenance"]["measured.peak_memory_bytes"] == "measured"
    # the machine check: a matmul, a memory copy and the run dir's disk, each measured; a CPU has no table
    # figures to hold the first two against, the disk is held against plan's checkpoint assumption
    checks = {c["what"].split(" (")[0]: c for c in plan["machine"]["checks"]}
    assert set(checks) == {"matmul", "memory copy", "disk write"} and all(
        c["value"] > 0 for c in checks.values()
    )
    assert checks["matmul"]["ratio"] is None and checks["disk write"]["ratio"] > 0
    assert checks["matmul"]["unit"] == "GFLOP/s" and checks["matmul"]["value"] > 1  # not "0.0 TFLOP/s"
    assert str(tmp_path) in plan["machine"]["checks"][2]["what"]  # the run dir's own disk
    with open(tmp_path / "real.log", "w") as log:  # its own peak RSS (VmHWM), not this process's
        code, peak = run_measuring_peak_rss(["train", *args], log, tmp_path)
    assert code == 0
    wall = max(r["elapsed_s"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "elapsed_s" in r)
    assert abs(plan["wall_hours"] * 3600 - wall) <= 0.35 * wall, (plan["wall_hours"] * 3600, wall)
    assert abs(plan["measured"]["peak_memory_bytes"] - peak) <= 0.25 * peak, (plan["measured"], peak)

    # plan --from-run: the real run's own parts, its own config re-planned, give back its wall time
    code, out, err = run_cli("plan", "--from-run", tmp_path / "run", "--json")
    assert code == 0, err
    again = json.loads(out)
    parts = again["measured"]
    assert again["time_source"] == "measured" and parts["eval_s"] > 0 and parts["checkpoint_s"] > 0
    assert again["evaluations"] == 3 and again["checkpoints"] == 3 and parts["run_steps"] == 45
    assert abs(again["wall_hours"] * 3600 - parts["run_wall_s"]) <= 0.10 * parts["run_wall_s"], again
    code, out, _ = run_cli("plan", "--from-run", tmp_path / "run", "--train.max_steps=120")
    assert code == 0 and "wall time (measured)" in out and "120 steps x" in out
