"""The $ guard: fake clock, fake budget.json, the training loop's response, and a property test."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.budget_helpers import T0, FakeClock, budget_file, iso

from pretrainer.config.schema import BudgetConfig
from pretrainer.core.errors import UserError
from pretrainer.train.budget import BudgetGuard, parse_budget


def test_estimate_without_a_file_uses_price_gpus_and_time():
    guard = BudgetGuard(BudgetConfig(cap_usd=35, usd_per_gpu_hour=2.0), gpus=4, clock=FakeClock())
    decision = guard.check(elapsed_s=3 * 3600, remaining_s=2 * 3600)
    assert decision.reading.spent_usd == pytest.approx(
        24.0
    ) and decision.reading.projected_total_usd == pytest.approx(40.0)
    assert decision.action == "stop"


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


def test_a_budget_file_that_is_a_fifo_does_not_block_and_falls_back_to_the_estimate(tmp_path):
    import os
    import threading

    fifo = tmp_path / "budget.json"
    os.mkfifo(fifo)  # no writer: a plain open() would wait forever, deaf to SIGTERM
    guard = BudgetGuard(BudgetConfig(cap_usd=10, usd_per_gpu_hour=1.0, file=str(fifo)), gpus=1)
    readings = []
    reader = threading.Thread(target=lambda: readings.append(guard.read(3600, 3600)), daemon=True)
    reader.start()
    reader.join(10)
    assert readings, "reading budget.file blocked on a FIFO"
    assert readings[0].source == "estimate" and readings[0].spent_usd == pytest.approx(1.0)
    assert readings[0].problem == f"{fifo} is not a regular file (a FIFO or device?); using the estimate"


def test_a_resumed_launch_projects_with_its_measured_step_only_for_the_same_step(tmp_path):
    """The launch check's step time comes from the run's earlier launches, when they ran the same step: as
    many ranks and tokens per step (a resume on 8 GPUs after 1 does not inherit one GPU's step time)."""
    import json

    from pretrainer.train.budget import measured_step_s

    records = [
        {"step": s, "loss": 3.0, "tokens": s * 1000, "elapsed_s": 5 + 0.5 * s, "tokens_per_s": 2000.0}
        for s in (10, 20, 30)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    saved = {"hardware": {"world_size": 1}}
    assert measured_step_s(tmp_path, saved, 1, 1000) == pytest.approx(0.5)
    assert measured_step_s(tmp_path, saved, 8, 1000) is None
    assert measured_step_s(tmp_path, saved, 1, 2000) is None
    assert measured_step_s(tmp_path / "nothing", saved, 1, 1000) is None


def test_a_negative_or_non_finite_figure_is_malformed_not_a_bigger_cap():
    """spent_usd: -100 raised the cap by $100 without a word."""
    for spent in (-100, float("nan")):
        figures = {"rate_usd_per_hr": 1.0, "hours_elapsed": 1.0, "projected_total_usd": 2.0}
        raw = json.dumps({"spent_usd": spent, **figures, "last_update_utc": iso(T0)})
        reading, problem = parse_budget(raw, T0, stale_after_s=600)
        assert reading is None and problem == "malformed (negative or non-finite numbers)"
