"""Spike drills on CPU: a tiny model on the real stdlib corpus, injected failures, detection,
classification, recovery and the written post-mortem."""

import json
import os
import re

import numpy as np
import pytest
from helpers import tiny_config, tiny_overrides

from pretrainer.analysis.report.postmortem import write_postmortem
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.train.loop import train

N = 40  # the injection step
ROLLBACK = {"spike.action": "rollback", "eval.every": 80}  # validation at the start and the end
# a drill that only needs its spike flagged and classified stops 10 steps after it (the schedule stays 80's)
CLASSIFIED_BY = {"train.stop_at_step": N + 10}


def drill(stdlib_data, run, **extra):
    settings = {
        "train.max_steps": 80,
        "train.micro_batch": 16,
        "optim.lr": 1e-2,
        "eval.every": 0,
        "ckpt.every": 10,
        "spike.window": 32,
        "spike.min_values": 16,
        "spike.inject_at_step": N,
        **extra,
    }
    return tiny_config(stdlib_data, run, **settings)


def spikes(run) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("spike")]


@pytest.fixture(scope="module")
def rare_drill(stdlib_data, tmp_path_factory):
    """The rare-token drill, logged only: what the detection, classification and figure tests read."""
    run = tmp_path_factory.mktemp("rare") / "run"
    train(drill(stdlib_data, run, **{"spike.inject_kind": "rare"}))
    return run


@pytest.fixture(scope="module")
def rare_rollback(stdlib_data, tmp_path_factory):
    """The rare-token drill under spike.action = rollback, run straight through."""
    run = tmp_path_factory.mktemp("rolled") / "run"
    train(drill(stdlib_data, run, **ROLLBACK))
    return run


def test_rare_token_drill_is_detected_classified_and_recovers(rare_drill, run_cli):
    run = rare_drill
    records = read_metrics(run / "metrics.jsonl")
    # logged explicitly
    assert [r["step"] for r in records if r.get("spike_injected")] == [40, 41, 42, 43, 44]
    assert N <= spikes(run)[0] <= N + 2
    code, out, _ = run_cli("postmortem", run)
    assert code == 0 and "step 40: rare-token gradient" in out
    text = (run / "spike-postmortem.md").read_text()
    assert "## Spike 1: rare-token gradient" in text
    assert "`rare` injected at steps 40-44" in text and "the drill's batch range (steps 40-44)" in text
    assert re.search(
        r"\*\*Outcome:\*\* recovered: loss back within 1% of (the pre-spike trend|its pre-spike level) at "
        r"step \d+",
        text,
    )
    assert "**When:** detected at step 40 (20" in text  # a UTC timestamp


def test_lr_drill_is_classified_learning_rate_too_high(stdlib_data, tmp_path):
    run = tmp_path / "run"
    lr = {"spike.inject_kind": "lr", "spike.lr_factor": 100, "spike.inject_batches": 3}
    train(drill(stdlib_data, run, **lr, **CLASSIFIED_BY))
    assert N <= spikes(run)[0] <= N + 2
    _, events, _ = write_postmortem(run)
    assert events[0].classification == "learning rate too high"
    assert "(100x): the LR changed" in (run / "spike-postmortem.md").read_text()


def test_constant_token_batch_is_classified_data_corruption(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(
        drill(
            stdlib_data, run, **{"spike.inject_kind": "data", "spike.data_mode": "constant"}, **CLASSIFIED_BY
        )
    )
    assert N <= spikes(run)[0] <= N + 2
    _, events, _ = write_postmortem(run)
    assert events[0].classification == "data corruption"
    assert "token ids were valid" in (run / "spike-postmortem.md").read_text()


def test_out_of_range_ids_are_rejected_before_the_embedding(stdlib_data, tmp_path, run_cli):
    run = tmp_path / "run"
    args = tiny_overrides(
        stdlib_data,
        run,
        **{
            "train.max_steps": 80,
            "spike.inject_at_step": N,
            "spike.inject_kind": "data",
            "spike.data_mode": "out_of_range",
            "eval.every": 0,
        },
    )
    code, _, err = run_cli("train", *args)
    errors = [line for line in err.splitlines() if "error:" in line]  # (stderr also carries the progress bar)
    assert code == 2 and len(errors) == 1
    assert re.search(
        r"step 40: token ids up to \d+ >= model.vocab_size 1024 .* rejected before the embedding", err
    )
    _, events, _ = write_postmortem(run)
    assert events[0].classification == "data corruption" and events[0].steps == [40]
    # with spike.action = skip the bad batch is dropped and the run goes on
    train(
        drill(
            stdlib_data,
            tmp_path / "skip",
            **{"spike.inject_kind": "data", "spike.data_mode": "out_of_range", "spike.action": "skip"},
        )
    )
    assert max(r["step"] for r in read_metrics(tmp_path / "skip" / "metrics.jsonl")) == 80


@pytest.fixture(scope="module")
def clean_run(stdlib_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("clean") / "run"
    train(drill(stdlib_data, run, **{"spike.inject_at_step": 0, "eval.every": 80}))
    return run


def final_val(run) -> float:
    return [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1]


@pytest.mark.parametrize("kind, flagged", [("rare", N), ("lr", N + 1)])
def test_rollback_ends_close_to_an_uninjected_run(kind, flagged, clean_run, stdlib_data, tmp_path, request):
    """A rare-token batch shows in its own step's loss; an LR x100 update shows one step later, so the
    checkpoint written right after it (step 40) already holds the damage and rollback passes over it."""
    if kind == "rare":  # the drill's defaults: 5 rare-token batches
        rolled = request.getfixturevalue("rare_rollback")
    else:
        rolled = tmp_path / "rolled"
        lr = {"spike.inject_kind": "lr", "spike.inject_batches": 3, "spike.lr_factor": 100}
        train(drill(stdlib_data, rolled, **ROLLBACK, **lr))
    records = read_metrics(rolled / "metrics.jsonl")
    rollback = [r for r in records if r.get("rollback")]
    # from before the onset
    assert rollback and rollback[0]["step"] == flagged and rollback[0]["to_step"] == 30
    # the bad window was skipped
    assert not [r for r in records if r.get("spike_injected") and r["step"] > flagged]
    assert abs(final_val(rolled) - final_val(clean_run)) < 0.1, (final_val(rolled), final_val(clean_run))
    write_postmortem(rolled)
    text = (rolled / "spike-postmortem.md").read_text()
    assert f"rolled back at step {flagged} to step 30" in text and "**Which action to pick:**" in text


def test_skip_never_freezes_after_an_lr_spike(stdlib_data, tmp_path):
    """LR x100 for 3 steps at step 80 of 100 under skip: the damage is in the weights before any step is
    flagged, so every later step looks like a spike. After spike.max_consecutive flags in a row the
    detector takes the new level as normal, updates resume, and the loss falls from there."""
    run = tmp_path / "run"
    cfg = drill(
        stdlib_data,
        run,
        **{
            "train.max_steps": 100,
            "spike.inject_at_step": 80,
            "spike.inject_kind": "lr",
            "spike.inject_batches": 3,
            "spike.action": "skip",
            "eval.every": 100,
        },
    )
    train(cfg)
    records = read_metrics(run / "metrics.jsonl")
    skipped = sorted(r["step"] for r in records if r.get("skipped"))
    regime = [r["step"] for r in records if r.get("spike_regime")]
    assert skipped and regime, (skipped, regime)
    longest, current = 0, 0  # the longest run of consecutive skipped updates
    for a, b in zip(skipped, skipped[1:] + [None]):
        current = current + 1 if b == a + 1 else 0
        longest = max(longest, current + 1 if b != a + 1 else longest)
    assert longest <= cfg.spike.max_consecutive - 1  # the documented bound
    assert regime[0] <= skipped[0] + cfg.spike.max_consecutive - 1
    loss = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert loss[100] < loss[83], (loss[83], loss[100])  # learning again after the drill window (steps 80-82)
    updated = [s for s in range(regime[0], 101) if s not in skipped]
    assert len(updated) >= 100 - regime[0] - cfg.spike.max_consecutive


def test_skip_drops_flagged_updates(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(drill(stdlib_data, run, **{"spike.inject_kind": "rare", "spike.action": "skip"}, **CLASSIFIED_BY))
    flagged = [r for r in read_metrics(run / "metrics.jsonl") if r.get("spike")]
    assert flagged and all(r["skipped"] == 1.0 for r in flagged)


def test_postmortem_figures_are_real_plots(rare_drill):
    import matplotlib.image as mpimg

    run = rare_drill
    write_postmortem(run)
    image = mpimg.imread(run / "spike-1.png")[..., :3]
    assert image.shape[1] > 1000
    # C0, C3
    loss_line, flagged_batch = (np.array([0x1F, 0x77, 0xB4]) / 255, np.array([0xD6, 0x27, 0x28]) / 255)
    for colour in (loss_line, flagged_batch):
        assert (np.abs(image - colour).max(axis=-1) < 0.05).sum() > 200


def test_a_stop_right_after_a_rollback_keeps_it(rare_rollback, stdlib_data, tmp_path, monkeypatch):
    """SIGTERM arriving as a rollback (step 40 -> 30) completes: the stop before the next step writes
    step 30 again, now with the data moved past the spike and the rollback counted, so the resumed
    run continues exactly as an uninterrupted one."""
    import signal

    from pretrainer.artifacts.checkpoint import latest_checkpoint
    from pretrainer.core.errors import RunStopped
    from pretrainer.train.spikes import SpikeGuard

    settings, straight, split = ROLLBACK, rare_rollback, tmp_path / "split"
    rolled_back = SpikeGuard.rolled_back

    def and_a_signal(self, *args, **kwargs):
        rolled_back(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # the run's handler records it; the next step's agreement stops

    monkeypatch.setattr(SpikeGuard, "rolled_back", and_a_signal)
    with pytest.raises(RunStopped):
        train(drill(stdlib_data, split, **settings))
    assert latest_checkpoint(split).name == "step-0000030"
    saved = json.loads((latest_checkpoint(split) / "state.json").read_text())
    assert saved["spike"]["rollbacks"] == 1  # the rewritten step 30: rolled back once, the data moved on
    rollback = next(r for r in read_metrics(split / "metrics.jsonl") if r.get("rollback"))
    assert (
        saved["data"]["cursor"]
        == rollback["skipped_sequences_from"] + rollback["skipped_sequences"]
        > 30 * 16
    )
    monkeypatch.undo()
    train(drill(stdlib_data, split, **settings))

    def last_of(run, key):
        return {
            r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r and "rollback" not in r
        }

    assert last_of(split, "loss") == last_of(straight, "loss")
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()  # noqa: E731
    assert final(split) == final(straight)


def test_rollback_lr_window_survives_an_interruption(stdlib_data, tmp_path):
    """A rollback at step 40 (to step 30) runs the next 25 steps at 0.3 x the LR. Stopped at step 45, inside
    that window, and resumed, the run continues exactly as an uninterrupted one: the window is saved state."""
    from pretrainer.artifacts.checkpoint import latest_checkpoint
    from pretrainer.optim.schedule import lr_at

    settings = {
        "spike.action": "rollback",
        "spike.rollback_lr_factor": 0.3,
        "spike.rollback_lr_steps": 25,
        "eval.every": 80,
    }
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(drill(stdlib_data, straight, **settings))
    train(drill(stdlib_data, split, **settings, **{"train.stop_at_step": 45}))
    assert [r["to_step"] for r in read_metrics(split / "metrics.jsonl") if r.get("rollback")] == [30]
    assert latest_checkpoint(split).name == "step-0000045"
    train(drill(stdlib_data, split, **settings))  # resume = auto

    def last_of(run, key):  # steps 31-39 ran twice (before and after the rollback): the later one counts
        return {
            r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r and "rollback" not in r
        }

    cfg = drill(stdlib_data, straight, **settings)
    lrs = last_of(straight, "lr")
    # inside the window
    assert all(lrs[s] == pytest.approx(0.3 * lr_at(s - 1, cfg.optim, 80)) for s in range(46, 56))
    assert all(lrs[s] == pytest.approx(lr_at(s - 1, cfg.optim, 80)) for s in range(56, 81))  # after it
    assert last_of(split, "lr") == lrs
    assert last_of(split, "loss") == last_of(straight, "loss")  # identical floats at every step
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()  # noqa: E731
    assert final(split) == final(straight)


def test_a_spike_between_logging_steps_is_explained_from_its_own_record(stdlib_data, tmp_path):
    """The quickstart's own spike fell between logging steps (log.every 10): the post-mortem said "no LR
    logged around the event" and "update/param 0" beside a table showing both, and "did not recover"
    while the loss kept falling. The flagged step's record carries its LR; a value not logged is said so;
    back at its pre-spike level is a recovery; the figure draws the flagged step itself."""
    run = tmp_path / "run"
    extra = {"spike.inject_at_step": 43, "spike.inject_batches": 1, "log.every": 10, "train.max_steps": 120}
    train(drill(stdlib_data, run, **extra))
    flagged = spikes(run)
    assert flagged and all(s % 10 for s in flagged), flagged  # between logging steps
    _, events, _ = write_postmortem(run)
    text = (run / "spike-postmortem.md").read_text()
    assert "no LR logged" not in text and "LR as scheduled" in text, text
    assert "update/param 0 " not in text and "update/param 0\n" not in text
    assert "**Outcome:** recovered" in text, text
    assert (run / "spike-1.png").is_file()
    from pretrainer.analysis.report.spike_figure import step_position

    assert step_position(43, [30, 40, 50, 60]) == pytest.approx(1.3)  # where step 43 falls among logged rows
