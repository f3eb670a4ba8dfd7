"""The optimizer registry: every optim.name has one entry, the config's recipe table names the same
ones, and each entry's own update norm is the size of the update its optimizer really applied."""

import importlib.util

import pytest
import torch

from pretrainer.config.schema import OPTIMIZER_RECIPES, ModelConfig, OptimConfig, key_allowed
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer
from pretrainer.optim.registry import OPTIMIZERS, build_optimizer, describe_optimizer, update_norm
from pretrainer.optim.sizes import optimizer_state_bytes, planned_state_bytes


def test_the_registry_the_recipes_and_the_schema_name_the_same_optimizers():
    assert tuple(OPTIMIZERS) == tuple(OPTIMIZER_RECIPES) == key_allowed()["optim.name"]
    assert all(kind.name == name for name, kind in OPTIMIZERS.items())


def test_an_unknown_optimizer_in_a_config_built_in_code_is_one_line():
    model = Transformer(ModelConfig(vocab_size=128, seq_len=16, d_model=64, n_layer=1, n_head=2))
    with pytest.raises(UserError, match=r"optim.name = 'lion' is not an optimizer here; choose one of adamw"):
        build_optimizer(model, OptimConfig(name="lion", lr=1e-2), "cpu")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_s_update_norm_is_the_update_it_applied(name):
    if name.endswith("bit") and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    torch.manual_seed(0)
    # matrices of 4,096+ values, so the low-bit optimizers quantise some moments
    model = Transformer(ModelConfig(vocab_size=128, seq_len=16, d_model=64, n_layer=1, n_head=2))
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-2), "cpu")
    assert describe_optimizer(optimizer)["name"] == name
    for _ in range(2):
        x = torch.randint(0, 128, (2, 16))
        model(x, x)[1].backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    moved = torch.sqrt(sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before)))
    # quantised moments enter dequantised: within their quantisation error of the applied update
    tolerance = {32: 1e-4, 8: 0.05, 4: 0.2}[OPTIMIZERS[name].moment_bits]
    assert update_norm(optimizer).item() == pytest.approx(moved.item(), rel=tolerance)
    planned = planned_state_bytes(
        OPTIMIZERS[name], [tuple(p.shape) for p in model.parameters()], hidden=_hidden(model)
    )
    assert planned == optimizer_state_bytes(optimizer)


def _hidden(model):
    from pretrainer.optim.muon import hidden_flags

    return hidden_flags(model)
