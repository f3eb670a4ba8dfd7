"""The optimizer registry: every optim.name is one entry (config/optimizers.py) naming its module, a new
optimizer is that module plus its entry, and each one's update norm is the size of the update it really
applied."""

import importlib
import importlib.util

import pytest
import torch

from pretrainer.config.keys import key_allowed
from pretrainer.config.optimizers import OptimizerEntry
from pretrainer.config.schema import ModelConfig, OptimConfig
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer
from pretrainer.optim.registry import OPTIMIZERS, build_optimizer, describe_optimizer, update_norm
from pretrainer.optim.sizes import optimizer_state_bytes, planned_state_bytes


def test_every_entry_names_its_module_and_the_schema_allows_exactly_the_entries():
    assert tuple(OPTIMIZERS) == key_allowed()["optim.name"]
    for name, entry in OPTIMIZERS.items():
        assert entry.name == name and entry.module.startswith("pretrainer.optim.")
        if entry.module.endswith("lowbit") and importlib.util.find_spec("torchao") is None:
            continue
        module = importlib.import_module(entry.module)
        assert all(callable(getattr(module, f, None)) for f in ("build", "update_norm", "implementation"))
        assert not entry.extra_flops or callable(getattr(module, "flops_per_step", None))


NEW_OPTIMIZER = """
import torch

def build(groups, model, cfg, *, entry, compile_step):
    optimizer = torch.optim.SGD(groups, lr=cfg.lr)
    optimizer.found_inf = None
    return optimizer

def implementation(optimizer):
    return "plain SGD"

def update_norm(optimizer, skipped=None):
    return torch.tensor(0.0)

def flops_per_step(model):
    return 7
"""


def test_a_new_optimizer_is_its_module_and_one_entry(tmp_path, monkeypatch):
    """Nothing else to change: built, described, its FLOPs and update norm asked through its own module,
    and its auto recipe resolved from its entry."""
    from pretrainer.config.resolve import auto_lr
    from pretrainer.optim import registry

    (tmp_path / "plain_sgd.py").write_text(NEW_OPTIMIZER)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = OptimizerEntry("sgd", "plain_sgd", 1e-2, 0.2, extra_flops=True)
    monkeypatch.setitem(OPTIMIZERS, "sgd", entry)
    model = Transformer(ModelConfig(vocab_size=128, seq_len=16, d_model=64, n_layer=1, n_head=2))
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=auto_lr(64, "sgd")), "cpu")
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 2e-2
    assert describe_optimizer(optimizer) == {"name": "sgd", "implementation": "plain SGD"}
    assert registry.optimizer_flops_per_step("sgd", model) == 7 and update_norm(optimizer).item() == 0


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
