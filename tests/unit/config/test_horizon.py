"""The horizon in the user's units: exactly one of max_steps, max_tokens, tokens_per_param and epochs,
turned into steps by resolve (one source of truth), the same steps `plan` prints; max_hours is a
wall-clock limit on top (plan says where it stops the run)."""

from __future__ import annotations

import math

import pytest

from pretrainer.analysis.plan import make_plan
from pretrainer.analysis.plan_text import format_plan
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


def test_a_saved_run_keeps_its_horizon_and_a_new_one_replaces_it(tmp_path):
    """A run resumed with its saved config derives its steps again from the horizon it was given (the
    world size may have changed); a horizon on the command line replaces the saved one."""
    from pretrainer.artifacts.run_config import load_train_config
    from pretrainer.config.keys import save_config

    run = tmp_path / "run"
    run.mkdir()
    saved = resolve(load_config(None, [*SHAPE, f"--run.dir={run}", "--train.max_tokens=1000000"]))
    save_config(saved, run / "config.toml")  # as the trainer saves it: max_steps 977 and max_tokens
    resumed = load_train_config(None, [f"--run.dir={run}"])
    assert resolve(resumed, world_size=2).train.max_steps == math.ceil(1_000_000 / (2 * TOKENS_PER_STEP))
    longer = load_train_config(None, [f"--run.dir={run}", "--train.max_steps=2000"])
    assert resolve(longer).train.max_steps == 2000 and longer.train.max_tokens == 0


def test_the_default_recipe_resolves_to_numbers_for_the_width_and_the_horizon(tmp_path):
    from pretrainer.config.keys import save_config
    from pretrainer.config.optimizers import OPTIMIZERS
    from pretrainer.config.resolve import auto_lr

    narrow = resolve(load_config(None, [*SHAPE, "--model.d_model=128", "--train.max_tokens=1000000"]))
    wide = resolve(load_config(None, [*SHAPE, "--model.d_model=512", "--train.max_tokens=1000000"]))
    assert narrow.optim.name == "muon" and narrow.optim.lr == auto_lr(128) > wide.optim.lr == auto_lr(512) > 0
    # the warmup is a fraction of the steps the horizon became, not a fixed count
    assert narrow.optim.warmup_steps == round(OPTIMIZERS["muon"].warmup_fraction * 977) > 0
    adamw = resolve(load_config(None, [*SHAPE, "--optim.name=adamw", "--train.max_tokens=1000000"]))
    assert (
        adamw.optim.warmup_steps
        == round(OPTIMIZERS["adamw"].warmup_fraction * 977)
        > narrow.optim.warmup_steps
    )
    assert adamw.optim.lr == auto_lr(128, "adamw") == narrow.optim.lr / 2  # AdamW's own, measured
    # what a run saves holds the numbers, and reads back to them
    save_config(narrow, tmp_path / "config.toml")
    again = resolve(load_config(tmp_path / "config.toml"))
    assert (again.optim.lr, again.optim.warmup_steps) == (narrow.optim.lr, narrow.optim.warmup_steps)
    # given numbers stand, "auto" is accepted as written, and `plan` shows what the run will use
    given = resolve(
        load_config(None, [*SHAPE, "--optim.lr=1e-3", "--optim.warmup_steps=7", "--train.max_steps=50"])
    )
    assert (given.optim.lr, given.optim.warmup_steps) == (1e-3, 7)
    cfg = load_config(None, [*SHAPE, "--optim.lr=auto", "--optim.warmup_steps=auto", "--train.max_steps=200"])
    assert format_plan(make_plan(cfg)).count(f"{auto_lr(cfg.model.d_model):g}") >= 1
