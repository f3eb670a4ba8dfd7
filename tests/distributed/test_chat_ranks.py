"""the chat format, masked loss, document packing, mixtures, stage chaining and chat."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from support.chat_helpers import SMALL

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.data.data_dir import open_data_dir
from pretrainer.data.loader import SequenceLoader
from pretrainer.model.loss import IGNORE_INDEX
from pretrainer.train.loop import train

# --- the whole step's masked mean, across micro-batches and ranks ---


def test_masked_mean_over_a_step_is_over_all_counted_targets_and_two_ranks_match(chat_data, tmp_path):
    from helpers import train_ranks

    steps = {
        "train.max_steps": 3,
        "train.micro_batch": 4,
        "log.every": 1,
        "eval.every": 0,
        "ckpt.every": 0,
        **SMALL,
    }
    single = tmp_path / "single"
    cfg = tiny_config(chat_data, single, **steps, **{"train.grad_accum": 2})
    train(cfg)
    # by hand: the initial model on the first step's 8 windows (2 micro-batches of uneven assistant-token
    # counts)
    from pretrainer.artifacts.runs import build_model
    from pretrainer.config.resolve import resolve

    data = open_data_dir(chat_data)
    resolved = resolve(cfg, data=data)
    assert resolved.data.packing == "document"
    torch.manual_seed(resolved.train.seed)
    model = build_model(resolved)
    sources, _ = data.sources("train", 64, "document")
    loader = SequenceLoader(sources, 64, micro_batch=4, grad_accum=2, seed=resolved.train.seed)
    total, count = 0.0, 0
    for x, y in loader.next_step():
        losses, _ = model(x, y, per_token=True, doc_separator=data.eot_id)
        total, count = total + losses.sum().item(), count + int((y != IGNORE_INDEX).sum())
    local_counts, step_count = loader.last_step_counts
    # uneven micro-batches; the loader counts what the loss counts
    assert len(set(local_counts)) == 2 and step_count == count
    logged = {r["step"]: r for r in read_metrics(single / "metrics.jsonl") if "loss" in r}
    assert logged[1]["loss"] == pytest.approx(total / count, rel=1e-5)
    assert logged[1]["trained_tokens"] == count < logged[1]["tokens"]
    # 2 gloo ranks x 1 micro-batch read what 1 process x 2 micro-batches reads: the same losses and weights
    two = tmp_path / "two"
    train_ranks(
        2,
        *[
            f"--{k}={v}"
            for k, v in {
                "data.dir": chat_data,
                "run.dir": two,
                "mlflow.enabled": False,
                "optim.name": "adamw",
                "optim.lr": 3e-3,
                "optim.warmup_steps": 5,
                **steps,
            }.items()
        ],
    )
    for step, record in {r["step"]: r for r in read_metrics(two / "metrics.jsonl") if "loss" in r}.items():
        assert record["loss"] == pytest.approx(logged[step]["loss"], abs=1e-5)
        assert record["trained_tokens"] == logged[step]["trained_tokens"]
