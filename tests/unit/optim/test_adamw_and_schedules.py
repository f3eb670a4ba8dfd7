from pathlib import Path

import pytest
from helpers import tiny_config

from pretrainer.config.schema import OptimConfig
from pretrainer.model import Transformer
from pretrainer.optim.adamw import param_groups
from pretrainer.optim.schedule import lr_at


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, cos, 100) == pytest.approx(0.1) and lr_at(9, cos, 100) == pytest.approx(1.0)
    assert lr_at(55, cos, 100) == pytest.approx(0.55) and lr_at(100, cos, 100) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert (
        lr_at(79, wsd, 100) == 1.0
        and lr_at(90, wsd, 100) == pytest.approx(0.5)
        and lr_at(100, wsd, 100) == 0.0
    )


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = Transformer(
        tiny_config(
            Path("unused"),
            Path("unused"),
            **{"model.arch": "gpt2", "model.n_kv_head": 0, "model.vocab_size": 100},
        ).model
    )
    decay, no_decay = param_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in decayed}
    assert names and all(n.endswith("proj.weight") for n in names)
    assert (
        no_decay["weight_decay"] == 0.0
        and id(model.wte.weight) not in decayed
        and id(model.wpe.weight) not in decayed
    )
