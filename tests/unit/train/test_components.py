"""Each trainer component on its own, built without a training run: its votes, its stop request, its
metrics, its work between steps, its state. The components' wiring into whole runs is what the
integration tests check; here each one's behaviour is pinned down where it is cheap to."""

import io
import json
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.budget_helpers import FakeClock

from pretrainer.artifacts.checkpoint import list_checkpoints, load_checkpoint
from pretrainer.config.load import load_config
from pretrainer.config.schema import AlertsConfig, BudgetConfig, ModelConfig, SpikeConfig
from pretrainer.data.unigram import UnigramStats
from pretrainer.model import Transformer
from pretrainer.train.alerts import Alerts
from pretrainer.train.checkpoint import Checkpointing
from pretrainer.train.component import Component, Step, Votes
from pretrainer.train.components import REGISTRY
from pretrainer.train.console import ProgressBar
from pretrainer.train.distributed import DistEnv
from pretrainer.train.evaluation import Evaluation
from pretrainer.train.norms import Norms
from pretrainer.train.perf import SpeedMonitor
from pretrainer.train.profiler import Profiler
from pretrainer.train.spikes import SpikeGuard
from pretrainer.train.state import RunClock
from pretrainer.train.stopping import Stopper, StopSignal, TimeLimits
from pretrainer.train.tracking import SequenceLog

ONE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def config(*overrides):
    return load_config(None, [f"--{o}" for o in overrides])


def tiny_model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2))


def trained_one_step(model):
    """A model's AdamW after one real step (state to save, an update to measure), and ||delta theta||."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    delta = torch.sqrt(sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before)))
    return optimizer, delta.item()


def test_votes_agree_by_name_whatever_order_they_were_cast_in():
    mine, other_rank = Votes(), {"budget": 0, "drop_batch": 1, "signal": 15}
    mine.cast("signal", 0)
    mine.cast("budget", 2)
    mine.cast("drop_batch", 0)
    mine.cast("budget", 1)  # a second vote on one name keeps the largest
    # the other rank's values in the same (sorted) order: what agree_max's all-reduce pairs them with
    agreed = mine.agree(
        lambda values: [max(a, b) for a, b in zip(values, [other_rank[n] for n in sorted(other_rank)])]
    )
    assert agreed == {"budget": 2, "drop_batch": 1, "signal": 15}


def test_the_registry_builds_each_component_under_its_own_name():
    assert list(REGISTRY)[0] == "alerts" and list(REGISTRY)[-1] == "checkpointing"
    for name, build in REGISTRY.items():
        cls = build.__self__
        assert issubclass(cls, Component) and cls.name == name


def stopper(**limits):
    stop = Stopper(
        BudgetConfig(),
        ONE_PROCESS,
        StopSignal(),
        time.time,
        lambda record: None,
        say=lambda text: None,
        resume_command="pretrainer train --run.dir=runs/a",
        limits=TimeLimits(**limits),
    )
    stop.run_clock, stop.max_steps, stop.hang_drill_step = RunClock(), 100, 0
    stop.start(0)
    return stop


def test_stopper_votes_a_signal_and_asks_for_a_checkpointed_stop_with_its_code():
    stop, votes = stopper(), Votes()
    stop.vote(Step(1, logging=False, last=False), votes)
    assert votes.values == {"budget": 0, "signal": 0, "time_limit": 0}
    stop.signal.signum = signal.SIGUSR1
    stop.vote(Step(4, logging=False, last=False), votes)
    agreed = votes.agree(list)
    request = stop.stop_request(Step(4, logging=False, last=False), agreed)
    assert (request.reason, request.exit_code, request.requeue) == ("signal", 138, False)
    assert "checkpoint written at step 3" in request.message and "--run.dir=runs/a" in request.message
    assert stop.state_dict() == 0.0  # nothing spent without a rate


@pytest.mark.parametrize("hours_before", [0.5, 1.0])
def test_stopper_stops_before_train_max_hours_would_pass(hours_before):
    """train.max_hours counts the run's earlier launches: a resume with the hour spent stops at once.
    (A limit the clock passes within the test would race a fast machine: microseconds.)"""
    stop, votes = stopper(max_hours=1.0), Votes()
    stop.run_clock.before = hours_before * 3600
    stop.vote(Step(1, logging=False, last=False), votes)
    request = stop.stop_request(Step(1, logging=False, last=False), votes.agree(list))
    stopped = (
        None if request is None else (request.reason, request.exit_code, "train.max_hours" in request.message)
    )
    assert stopped == (None if hours_before < 1 else ("time_limit", 8, True))


def speed_monitor(*overrides, said=None, logged=None):
    cfg = config("log.every=2", *overrides)
    return SpeedMonitor(
        cfg,
        0,
        6e6,
        peak_tflops=1.0,
        world_size=1,
        device=torch.device("cpu"),
        first_step=0,
        attention="flash",
        say=(said if said is not None else []).append,
        log=(logged if logged is not None else []).append,
    )


def test_speed_monitor_measures_the_interval_s_tokens_per_second_and_mfu(monkeypatch):
    import pretrainer.train.perf as perf

    clock = FakeClock(tick=0)  # moved by its sleeps only: exact figures, whatever the machine's load
    monkeypatch.setattr(perf, "time", clock)
    speed = speed_monitor()
    loader = SimpleNamespace(next_step=lambda: clock.sleep(0.01) or [])
    for number in (1, 2):
        step = Step(number, logging=number == 2, last=False, tokens=1000 * number)
        speed.before_step(step)
        speed.read_batch(loader)  # 10 ms reading
        clock.sleep(0.03)  # 30 ms computing
        speed.after_step(step)
    figures = speed.metrics(step)
    assert figures["tokens_per_s"] == pytest.approx(2000 / 0.08)  # 2,000 tokens in 80 ms
    assert figures["mfu"] == pytest.approx(6e6 * 2000 / 0.08 / 1e12)
    assert figures["data_wait_fraction"] == pytest.approx(0.25)  # a quarter of the time spent reading


def test_speed_monitor_s_watchdog_votes_slow_and_asks_for_a_throughput_stop():
    said = []
    speed = speed_monitor(
        "train.min_tokens_per_s=1e12", "train.watchdog_steps=1", "train.watchdog_action=stop", said=said
    )
    speed.resume_command = "pretrainer train --run.dir=runs/a"
    step = Step(2, logging=True, last=False, tokens=100)
    speed.before_step(step)
    speed.after_step(step)
    step.record = speed.metrics(step)
    speed.after_log(step)
    votes = Votes()
    speed.vote(Step(3, logging=False, last=False), votes)
    request = speed.stop_request(Step(3, logging=False, last=False), votes.agree(list))
    assert (request.reason, request.exit_code) == ("throughput_stop", 6)
    assert "min_tokens_per_s" in request.message and any("watchdog" in line for line in said)


def test_alerts_end_with_the_kind_the_end_reason_table_gives(tmp_path):
    records = []
    alerts = Alerts(AlertsConfig(), tmp_path, True, records.append, lambda text: None, max_steps=10)
    alerts.before_step(Step(1, logging=False, last=False))
    alerts.after_log(Step(1, logging=False, last=False))
    alerts.ended("budget_stop", 4, 1, "projected over the cap")
    alerts.close()
    assert records[-1]["alert"] == "stopped" and "budget_stop (exit 4)" in records[-1]["message"]


def spike_guard(tmp_path, logged):
    return SpikeGuard(
        SpikeConfig(),
        UnigramStats(np.arange(1, 17)),
        16,
        8,
        0,
        tmp_path,
        ONE_PROCESS,
        logged.append,
        lambda text: None,
        time.time,
    )


def test_spike_guard_votes_to_drop_a_batch_with_ids_outside_the_vocabulary(tmp_path):
    guard = spike_guard(tmp_path, [])
    good = [(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))]
    bad = [(torch.full((2, 8), 16, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))]
    for micro_batches, expected in ((good, 0), (bad, 1)):
        votes = Votes()
        guard.vote(Step(1, logging=False, last=False, micro_batches=micro_batches), votes)
        assert votes.values == {"drop_batch": expected}
    assert guard.state_key == "spike" and guard.state_dict()["rollbacks"] == 0


def test_norms_give_the_parameter_norm_the_update_s_size_and_the_group_norms():
    model = tiny_model()
    optimizer, delta = trained_one_step(model)
    step = Step(1, logging=True, last=False, group_norms={"final": torch.tensor(2.5)})
    figures = Norms(model, optimizer).metrics(step)
    norm = torch.sqrt(sum(p.detach().pow(2).sum() for p in model.parameters())).item()
    assert figures["param_norm"] == pytest.approx(norm, rel=1e-5)
    assert figures["update_to_param"] == pytest.approx(delta / norm, rel=1e-3)  # from the state alone
    assert figures["grad_norm/final"] == 2.5


def test_the_console_says_one_line_per_logged_step():
    from tqdm import tqdm

    said = []
    console = ProgressBar(tqdm(total=10, file=io.StringIO()), said.append, 10, 512)
    step = Step(5, logging=True, last=False)
    console.after_step(step)
    step.record = {"step": 5, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 512.0}
    console.after_log(step)
    console.after_log(Step(6, logging=False, last=False))
    console.close()
    assert console.bar.n == 5 and said == [
        "step 5/10 | loss 2.0000 | lr 1.00e-03 | grad norm 0.500 | 512 tok/s | ETA 5s"
    ]


def test_the_sequence_log_writes_each_step_s_window_ids(tmp_path):
    loader = SimpleNamespace(last_step_ids=[[3, 4], [5]])
    log = SequenceLog(tmp_path / "sequences-rank0.jsonl", 0, loader)
    log.after_step(Step(1, logging=False, last=False))
    log.close()
    assert [json.loads(line) for line in (tmp_path / "sequences-rank0.jsonl").read_text().splitlines()] == [
        {"step": 1, "ids": [3, 4, 5]}
    ]


def test_evaluation_validates_every_eval_every_steps_and_at_the_end():
    validated, scored = [], []
    evals = SimpleNamespace(
        validate=lambda model, step, tokens: validated.append(step) or 1.0,
        in_context=lambda model, plain, step, tokens: scored.append(step),
        val_loss_at=lambda step: 1.0 if step in validated else None,
    )
    cfg = config("eval.every=5", "eval.tasks_every=4", "train.max_steps=12")
    trainer = SimpleNamespace(wrapped=None, model=None, state=SimpleNamespace(step=0))
    evaluation = Evaluation(evals, cfg, trainer)
    evaluation.at_start()
    worked = [evaluation.between_steps(Step(n, logging=False, last=n == 12, tokens=n)) for n in range(1, 13)]
    assert validated == [0, 5, 10, 12] and scored == [0, 4, 8, 12]
    assert [n for n, w in zip(range(1, 13), worked) if w] == [4, 5, 8, 10, 12]
    trainer.state.step = 10
    assert evaluation.state_dict() == 1.0


def test_checkpointing_writes_at_its_cadence_and_at_the_last_step(tmp_path):
    model = tiny_model()
    optimizer, _ = trained_one_step(model)
    logged = []
    trainer = SimpleNamespace(
        cfg=config("ckpt.every=3", "ckpt.keep=10"),
        env=ONE_PROCESS,
        run_dir=tmp_path,
        state=SimpleNamespace(step=0, saved_step=-1),
        run_clock=RunClock(),
        wrapped=model,
        model=model,
        optimizer=optimizer,
        run_log=SimpleNamespace(write=logged.append),
        start=SimpleNamespace(step_tokens=512),
    )
    trainer.state_json = lambda: {"step": trainer.state.step, "tokens": 512 * trainer.state.step}
    checkpointing = Checkpointing.build(trainer)
    for n in range(1, 8):
        trainer.state.step = n
        checkpointing.between_steps(Step(n, logging=False, last=n == 7))
    checkpointing.close()
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-0000003", "step-0000006", "step-0000007"]
    weights, _, state = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert state["step"] == 7 and torch.equal(weights["norm.weight"], model.norm.weight.detach())
    assert [r["step"] for r in logged if "checkpoint_s" in r] == [3, 6, 7] and trainer.state.saved_step == 7


def test_the_profiler_traces_its_window_of_steps_and_nothing_else(tmp_path):
    said = []
    profiler = Profiler(tmp_path / "profile", 2, 3, rank=0, device=torch.device("cpu"), say=said.append)
    a = torch.randn(64, 64)
    for n in range(1, 6):
        step = Step(n, logging=False, last=False)
        profiler.before_step(step)
        (a @ a).sum()
        profiler.after_step(step)
    profiler.close()
    trace = json.loads((tmp_path / "profile" / "trace-steps-2-3-rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"step 2", "step 3", "aten::mm"} <= names and not {"step 1", "step 4"} & names
    assert len(said) == 1 and not list((tmp_path / "profile").glob(".*"))  # no temp file left


def test_a_run_that_ends_inside_the_profiler_s_window_still_writes_its_trace(tmp_path):
    profiler = Profiler(tmp_path, 1, 5, rank=0, device=torch.device("cpu"), say=lambda text: None)
    step = Step(1, logging=False, last=False)
    profiler.before_step(step)
    torch.ones(8).sum()
    profiler.after_step(step)
    profiler.close()
    assert (tmp_path / "trace-steps-1-5-rank0.json").exists()


def test_the_tracker_registry_and_the_config_schema_name_the_same_trackers():
    from pretrainer.config.schema import TRACKERS as SCHEMA_NAMES
    from pretrainer.train.trackers import TRACKERS

    assert tuple(TRACKERS) == SCHEMA_NAMES
    for tracker in TRACKERS.values():
        assert tracker.package and tracker.install.startswith("pip install") and callable(tracker.open)


def test_alerts_act_on_typed_events_not_on_a_record_s_keys(tmp_path):
    from pretrainer.train.events import BudgetWarning, RolledBack, Spike
    from pretrainer.train.tracking import RunLog

    run_log = RunLog(config("track.backends=none"), tmp_path, -1, True, lambda text: None)
    alerts = Alerts(AlertsConfig(), tmp_path, True, run_log.write, lambda text: None, max_steps=10)
    run_log.alerts = alerts
    run_log.write({"step": 1, "spike": 1.0, "spike_loss": 9.0})  # a plain record: no alert
    run_log.write(Spike({"step": 2, "spike": 1.0, "spike_loss": float("nan"), "spike_grad_norm": 1.0}))
    run_log.write(BudgetWarning({"step": 3, "budget_warn": 1.0, "spent_usd": 2.5}))
    run_log.write(RolledBack({"step": 4, "rollback": 1.0, "to_step": 2}))
    alerts.close()
    run_log.close("finished")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "alert" not in r] == [1, 2, 3, 4]  # every event's record kept
    assert [(r["step"], r["alert"], r["message"]) for r in records if "alert" in r] == [
        (2, "non_finite", "loss nan, grad norm 1"),
        (3, "budget_warning", "spent $2.50"),
        (4, "rollback", "rolled back to step 2"),
    ]


def test_a_dropped_step_s_profiler_range_ends_where_the_next_step_begins(tmp_path):
    profiler = Profiler(tmp_path, 1, 3, rank=0, device=torch.device("cpu"), say=lambda text: None)
    a = torch.randn(32, 32)
    for n, dropped in ((1, False), (2, True), (3, False)):
        step = Step(n, logging=False, last=False)
        profiler.before_step(step)
        (a @ a).sum()
        if not dropped:  # a dropped batch or a rollback never reaches after_step
            profiler.after_step(step)
    events = json.loads((tmp_path / "trace-steps-1-3-rank0.json").read_text())["traceEvents"]
    ranges = {e["name"]: e for e in events if e.get("name", "").startswith("step ") and e.get("ph") == "X"}
    assert sorted(ranges) == ["step 1", "step 2", "step 3"]
    assert ranges["step 2"]["ts"] + ranges["step 2"]["dur"] <= ranges["step 3"]["ts"]  # not nested
