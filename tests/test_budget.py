"""The $ guard: fake clock, fake budget.json, the training loop's response, and a property test."""

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from conftest import tiny_config, tiny_overrides
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrainer.artifacts.checkpoint import latest_checkpoint, list_checkpoints
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.schema import BudgetConfig
from pretrainer.core.errors import RunStopped, UserError
from pretrainer.train.budget import EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT, BudgetGuard, parse_budget
from pretrainer.train.loop import train

T0 = 1_900_000_000.0  # the fake clock's start (2030)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def budget_file(path: Path, spent: float, projected: float, updated: float = T0) -> Path:
    path.write_text(
        json.dumps(
            {
                "spent_usd": spent,
                "rate_usd_per_hr": 1.1,
                "hours_elapsed": spent / 1.1,
                "projected_total_usd": projected,
                "last_update_utc": iso(updated),
            }
        )
    )
    return path


class FakeClock:
    def __init__(self, start: float = T0, tick: float = 1.0):
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


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
    run = tmp_path / "run"
    result = train(
        guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=31, projected=34)), clock=FakeClock()
    )
    assert result["step"] == 12
    warnings = [r for r in read_metrics(run / "metrics.jsonl") if "budget_warn" in r]
    assert len(warnings) == 1 and warnings[0]["spent_usd"] == 31


def test_projected_over_cap_checkpoints_then_exits(stdlib_data, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RunStopped) as stopped:
        train(
            guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=20, projected=36)),
            clock=FakeClock(),
        )
    assert stopped.value.exit_code == EXIT_BUDGET_PROJECTED == 4
    assert latest_checkpoint(run).name == "step-0000001"  # first check is due at the first step
    assert any("budget_stop" in r for r in read_metrics(run / "metrics.jsonl"))


def test_spent_over_cap_exits_at_once_without_a_checkpoint(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 12, "train.stop_at_step": 10, "eval.every": 0}))
    assert [p.name for p in list_checkpoints(run)] == ["step-0000010"]
    with pytest.raises(RunStopped) as stopped:
        train(
            guarded(stdlib_data, run, budget_file(tmp_path / "b.json", spent=35.5, projected=40)),
            clock=FakeClock(),
        )
    assert stopped.value.exit_code == EXIT_BUDGET_SPENT == 5
    assert [p.name for p in list_checkpoints(run)] == ["step-0000010"]  # nothing new written


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


def test_estimate_without_a_file_uses_price_gpus_and_time():
    guard = BudgetGuard(BudgetConfig(cap_usd=35, usd_per_gpu_hour=2.0), gpus=4, clock=FakeClock())
    decision = guard.check(elapsed_s=3 * 3600, remaining_s=2 * 3600)
    assert decision.reading.spent_usd == pytest.approx(
        24.0
    ) and decision.reading.projected_total_usd == pytest.approx(40.0)
    assert decision.action == "stop"


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
    assert (
        code == 0 and "budget: projected $" in out
    )  # allowed; the guard's own estimate (measured step time) is tiny


def test_budget_check_dry_run(tmp_path, run_cli):
    import time

    path = budget_file(tmp_path / "b.json", spent=12, projected=36.5, updated=time.time())
    code, out, _ = run_cli(
        "budget-check",
        "--budget.file",
        path,
        "--budget.cap_usd=35",
        "--budget.usd_per_gpu_hour=1.1",
        "--dry-run",
    )
    assert code == 0 and "decision: stop" in out and "exit code 4" in out
    code, out, _ = run_cli(
        "budget-check", "--budget.file", path, "--budget.cap_usd=40", "--budget.usd_per_gpu_hour=1.1"
    )
    assert code == 0 and "decision: ok" in out
    with pytest.raises(UserError):
        from pretrainer.config.load import load_config

        load_config(None, ["--budget.cap_usd=10"])  # a cap needs a price for the estimate


def test_parse_budget_accepts_the_contract():
    reading, problem = parse_budget(
        json.dumps(
            {
                "spent_usd": 1,
                "rate_usd_per_hr": 1.1,
                "hours_elapsed": 1,
                "projected_total_usd": 5,
                "last_update_utc": iso(T0),
            }
        ),
        T0 + 10,
        900,
    )
    assert problem == "" and reading.projected_total_usd == 5


# --- property: the run never continues a check interval past projected > cap ---


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(1, 120), st.floats(0, 2), st.floats(0, 70), st.booleans()),
        min_size=1,
        max_size=80,
    ),
    st.floats(10, 600),
)
def test_guard_stops_within_one_check_interval_of_projected_over_cap(events, check_every):
    """A sidecar rewrites budget.json at random moments with random spend and projections; the loop
    asks the guard after every step. Whenever budget.json has said "over the cap" for longer than one
    check interval (plus one step, the loop's granularity), the run must already have stopped; and it
    never stops unless the file it read said so."""
    cap, now = 35.0, [T0]
    content = {"text": None, "over": False}
    guard = BudgetGuard(
        BudgetConfig(
            cap_usd=cap,
            usd_per_gpu_hour=0.001,
            file="budget.json",
            check_every_s=check_every,
            stale_after_s=1e9,
        ),
        gpus=1,
        clock=lambda: now[0],
        reader=lambda path: content["text"],
    )
    spent, over_since, max_dt = 0.0, None, 0.0
    for dt, spend, projected, sidecar_updates in events:
        now[0] += dt
        max_dt = max(max_dt, dt)
        if over_since is not None:
            assert now[0] - over_since <= check_every + max_dt, (
                "kept running a check interval past projected > cap"
            )
        if sidecar_updates:
            spent += spend
            total = max(projected, spent)
            content["text"] = json.dumps(
                {
                    "spent_usd": spent,
                    "rate_usd_per_hr": 1.0,
                    "hours_elapsed": 1.0,
                    "projected_total_usd": total,
                    "last_update_utc": iso(now[0]),
                }
            )
            content["over"] = total > cap
            over_since = (over_since or now[0]) if content["over"] else None
        decision = guard.check(elapsed_s=0, remaining_s=0)  # the loop asks after every step
        if decision is not None and decision.action in ("stop", "halt"):
            assert content["over"], "stopped although budget.json was under the cap"
            return
