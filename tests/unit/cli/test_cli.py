"""a CLI a newcomer can drive. A run dir is enough after the first command; likely
mistakes are said at start; logs read well in a file; outputs land where the layout says."""

from __future__ import annotations

import argparse

from helpers import tiny_overrides

from pretrainer.cli.main import build_parser
from pretrainer.config.load import load_config
from pretrainer.config.preflight import config_warnings, data_warnings
from pretrainer.data.data_dir import open_data_dir
from pretrainer.train.console import format_duration, step_line


def test_warnings_for_likely_mistakes(stdlib_data, tmp_path):
    """Problem 3: one line each, before the run starts (train) or in the plan."""
    cfg = load_config(
        None,
        tiny_overrides(
            stdlib_data,
            tmp_path,
            **{
                "train.max_steps": 20,
                "optim.warmup_steps": 50,
                "eval.every": 100,
                "ckpt.every": 100,
                "eval.batches": 10_000,
            },
        ),
    )
    said = config_warnings(cfg)
    assert len(said) == 4 and all("\n" not in line for line in said)
    assert (
        "never reaches optim.lr" in said[0]
        and "eval.every = 100" in said[1]
        and "ckpt.every = 100" in said[2]
    )
    assert "spike.min_values = 64" in said[3]
    assert config_warnings(load_config(None, ["--train.max_steps=1000"])) == []
    assert (
        "only at the last step"
        in config_warnings(load_config(None, ["--train.max_steps=100", "--optim.warmup_steps=100"]))[0]
    )
    data = open_data_dir(stdlib_data)
    said = data_warnings(cfg, data, world_size=1)
    assert any("fewer than eval.batches x train.micro_batch" in line for line in said)
    same = {"dataset": data.provenance(), "tokens_per_step": 8 * 64, "world_size": 1}
    assert not any("change" in line for line in data_warnings(cfg, data, 1, same))
    # re-prepared: a new created_utc
    recreated = {**same, "dataset": {**data.provenance(), "manifest_sha256": "0" * 64}}
    assert not any("changed" in line for line in data_warnings(cfg, data, 1, recreated))
    other_split = {**data.provenance()["splits"], "train": {"sha256": "0" * 64, "tokens": 1, "documents": 1}}
    changed = {**same, "dataset": {**data.provenance(), "splits": other_split}}
    assert any(
        "the data changed since the checkpoint (its splits differ" in line
        for line in data_warnings(cfg, data, 1, changed)
    )
    # resumed on two ranks without train.global_batch: twice the batch
    said = data_warnings(cfg, data, 2, same)
    assert any(
        "tokens per step change from 512 at the checkpoint (world size 1) to 1,024" in line for line in said
    )
    many_steps = load_config(None, tiny_overrides(stdlib_data, tmp_path, **{"train.max_steps": 100_000}))
    assert any("epochs of the train split" in line for line in data_warnings(many_steps, data, 1))


def test_step_line_reads_well_in_a_file():
    record = {
        "step": 40,
        "loss": 3.21,
        "lr": 3e-4,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        "mfu": 0.312,
        "spent_usd": 1.5,
    }
    line = step_line(record, end_step=100, tokens_per_step=1000)
    assert (
        line
        == "step 40/100 | loss 3.2100 | lr 3.00e-04 | grad norm 0.500 | 1,000 tok/s | MFU 31.2% | $1.50 | "
        "ETA 1m00s"
    )
    assert (format_duration(42), format_duration(125), format_duration(3725)) == ("42s", "2m05s", "1h02m")


def test_every_cli_option_has_help_text():
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.dest}"
        for name, sub in verbs.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == []


def test_budget_check_names_the_file_once(tmp_path, run_cli):
    code, out, _ = run_cli(
        "budget-check",
        "--budget.cap_usd=10",
        "--budget.usd_per_gpu_hour=2",
        f"--budget.file={tmp_path / 'budget.json'}",
        "--dry-run",
    )
    assert code == 0 and f"note: {tmp_path / 'budget.json'} is missing; using the estimate" in out
