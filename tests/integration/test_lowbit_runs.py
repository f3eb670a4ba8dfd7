"""8-bit and 4-bit AdamW (optim.name = adamw8bit | adamw4bit, torchao): they train, resume bit-exactly,
skip a flagged update as fused AdamW does, and plan's memory model predicts their state's size."""

import json
from pathlib import Path

import pytest
from helpers import tiny_config
from support.lowbit_helpers import LOW_BIT, records

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.core.errors import UserError
from pretrainer.train.loop import train

pytest.importorskip("torchao")


def resumed_equals_straight(name: str, data, tmp_path, steps: int, **extra) -> Path:
    """A run straight through and one stopped halfway and resumed: identical losses and final weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    settings = {"optim.name": name, "train.max_steps": steps, "ckpt.every": steps // 2, **extra}
    train(tiny_config(data, straight, **settings))
    train(tiny_config(data, split, **settings, **{"train.stop_at_step": steps // 2}))
    train(tiny_config(data, split, **settings))  # resume = auto, from the halfway checkpoint
    loss = lambda run: {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert loss(split) == loss(straight) and len(loss(straight)) == steps  # identical floats at every step
    assert loss(straight)[steps] < loss(straight)[1] - 0.2, loss(straight)  # and it trains
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()
    assert final(split) == final(straight)
    state = json.loads((latest_checkpoint(straight) / "state.json").read_text())
    assert state["optimizer"]["name"] == name and "torchao" in state["optimizer"]["implementation"]
    return straight


@pytest.mark.parametrize("name", LOW_BIT)
def test_low_bit_adamw_resumes_bit_exactly(name, stdlib_data, tmp_path):
    resumed_equals_straight(name, stdlib_data, tmp_path, 12, **{"eval.every": 0})


def test_resuming_with_another_optimizer_is_refused(stdlib_data, tmp_path):
    """Its state is the other optimizer's (fp32 moments vs quantised ones): a one-line error, not a crash
    at the first step or a silent fp32 state under an 8-bit name."""
    train(
        tiny_config(stdlib_data, tmp_path / "run", **{"train.max_steps": 2, "ckpt.every": 2, "eval.every": 0})
    )
    with pytest.raises(
        UserError, match=r"was trained with optim.name = 'adamw' \(this launch: 'adamw8bit'\)"
    ):
        train(tiny_config(stdlib_data, tmp_path / "run", **{"train.max_steps": 4, "optim.name": "adamw8bit"}))


@pytest.fixture(scope="module")
def adamw_run(stdlib_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("adamw") / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 40}))
    return run


@pytest.mark.parametrize("name", LOW_BIT)
def test_low_bit_adamw_learns_as_adamw_does(name, adamw_run, stdlib_data, tmp_path):
    """40 steps of the tiny model (test_train's resume run) against AdamW's (the resume is checked above)."""
    run = tmp_path / name
    train(tiny_config(stdlib_data, run, **{"optim.name": name, "train.max_steps": 40}))
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert state["optimizer"]["name"] == name and "torchao" in state["optimizer"]["implementation"]
    val = lambda run: [r["val_loss"] for r in records(run) if "val_loss" in r]
    assert val(run)[-1] < val(run)[0] - 0.5, val(run)  # it learns
    # the stated tolerance (README, docs/benchmarks.md): within 3% of AdamW's final validation loss
    assert val(run)[-1] == pytest.approx(val(adamw_run)[-1], rel=0.03), (val(run), val(adamw_run))
