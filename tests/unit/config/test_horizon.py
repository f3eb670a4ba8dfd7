"""The horizon in the user's units: exactly one of max_steps, max_tokens, tokens_per_param and epochs,
turned into steps by resolve (one source of truth), the same steps `plan` prints; max_hours is a
wall-clock limit on top (plan says where it stops the run)."""

from __future__ import annotations

import math

import pytest

from pretrainer.analysis.plan import format_plan, make_plan
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve, train_sequences
from pretrainer.core.errors import UserError
from pretrainer.model.transformer import total_parameters

SHAPE = ["--model.vocab_size=1024", "--model.seq_len=64", "--train.micro_batch=8", "--train.grad_accum=2"]
TOKENS_PER_STEP = 8 * 64 * 2


class Data:  # what resolve reads of a prepared data dir
    path = "data"
    vocab_size = 1024
    manifest = {"max_token_id": 1000, "splits": {"train": {"tokens": 100_001}, "val": {"tokens": 5_001}}}


def steps_for(*horizon: str, data=None) -> int:
    cfg = load_config(None, [*SHAPE, *horizon])
    return resolve(cfg, data=data, count_parameters=total_parameters).train.max_steps


def test_each_horizon_becomes_whole_steps_that_cover_it():
    params = total_parameters(load_config(None, SHAPE).model)
    assert steps_for("--train.max_steps=300") == 300
    assert steps_for("--train.max_tokens=1000000") == math.ceil(1_000_000 / TOKENS_PER_STEP) == 977
    assert steps_for("--train.tokens_per_param=20") == math.ceil(20 * params / TOKENS_PER_STEP)
    epoch_tokens = train_sequences(Data, 64) * 64
    assert steps_for("--train.epochs=2.5", data=Data) == math.ceil(2.5 * epoch_tokens / TOKENS_PER_STEP)


@pytest.mark.parametrize(
    "horizon",
    [
        ["--train.max_steps=300"],
        ["--train.max_tokens=1000000"],
        ["--train.tokens_per_param=20"],
        ["--train.epochs=2.5"],
        ["--train.max_steps=300", "--train.max_hours=0.01"],
    ],
)
def test_plan_prints_the_steps_resolve_gives(horizon):
    """`plan` resolves the same way the trainer does, and shows the horizon in every unit."""
    cfg = load_config(None, [*SHAPE, *horizon])
    plan = make_plan(cfg, gpu="h100-sxm", data=Data)
    assert plan["steps"] == steps_for(*horizon, data=Data) == plan["horizon"]["steps"]
    text = format_plan(plan)
    assert f"{plan['steps']:,} steps = {plan['steps'] * TOKENS_PER_STEP:,} tokens" in text
    assert "tokens/parameter" in text and "epochs" in text
    if "--train.max_hours=0.01" in horizon:  # 36 s at the planned speed: the whole horizon fits
        assert (
            plan["horizon"]["max_hours_steps"] == 300
            and "train.max_hours = 0.01 stops at the horizon" in text
        )


def test_one_horizon_only_and_one_is_needed():
    with pytest.raises(UserError, match="train.max_tokens and train.epochs are both set"):
        resolve(load_config(None, [*SHAPE, "--train.max_tokens=100", "--train.epochs=1"]), data=Data)
    with pytest.raises(UserError, match="no horizon: set one of train.max_steps, train.max_tokens"):
        resolve(load_config(None, SHAPE))
    with pytest.raises(
        UserError, match=r"train.max_steps = 5 and train.max_tokens = 1e\+06 \(977 steps\) disagree"
    ):
        cfg = load_config(None, SHAPE)
        cfg.train.max_steps, cfg.train.max_tokens = 5, 1_000_000  # as a config file that sets both
        resolve(cfg)
    with pytest.raises(UserError, match="train.epochs needs data.dir"):
        resolve(load_config(None, [*SHAPE, "--train.epochs=1"]))


def test_a_horizon_on_the_command_line_replaces_the_config_files(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[train]\nmax_steps = 300\n")
    cfg = load_config(config, [*SHAPE, "--train.max_tokens=1000000"])
    assert cfg.train.max_steps == 0 and resolve(cfg).train.max_steps == 977
