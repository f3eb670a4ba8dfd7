"""8-bit and 4-bit AdamW (optim.name = adamw8bit | adamw4bit, torchao): they train, resume bit-exactly,
skip a flagged update as fused AdamW does, and plan's memory model predicts their state's size."""

import pytest
from helpers import tiny_overrides
from support.lowbit_helpers import records

from pretrainer.artifacts.checkpoint import latest_checkpoint

pytest.importorskip("torchao")


def test_two_rank_ddp_resume_of_adamw8bit_is_bit_exact(stdlib_data, tmp_path):
    """The quantised moments cannot be broadcast as tensors: rank 0 sends their plain parts
    (distributed.py)."""
    from helpers import train_ranks

    settings = {
        "optim.name": "adamw8bit",
        "parallel.strategy": "ddp",
        "train.micro_batch": 4,
        "train.max_steps": 8,
        "ckpt.every": 4,
        "eval.every": 0,
    }
    train_ranks(2, *tiny_overrides(stdlib_data, tmp_path / "straight", **settings))
    train_ranks(2, *tiny_overrides(stdlib_data, tmp_path / "split", **settings, **{"train.stop_at_step": 4}))
    train_ranks(2, *tiny_overrides(stdlib_data, tmp_path / "split", **settings))
    loss = lambda run: {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert loss(tmp_path / "split") == loss(tmp_path / "straight") and len(loss(tmp_path / "straight")) == 8
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()
    assert final(tmp_path / "split") == final(tmp_path / "straight")
