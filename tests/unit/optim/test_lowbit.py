"""8-bit and 4-bit AdamW (optim.name = adamw8bit | adamw4bit, torchao): they train, resume bit-exactly,
skip a flagged update as fused AdamW does, and plan's memory model predicts their state's size."""

import sys

import pytest
import torch
from support.lowbit_helpers import LOW_BIT

import pretrainer.optim
from pretrainer.analysis.plan import make_plan
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer
from pretrainer.optim.registry import build_optimizer
from pretrainer.optim.sizes import is_quantised, optimizer_state_bytes
from pretrainer.optim.state_file import state_for_file, state_from_file

pytest.importorskip("torchao")


@pytest.mark.parametrize("name", ["adamw", *LOW_BIT])
def test_plan_predicts_the_optimizer_state_bytes(name):
    """The quickstart's shapes (4,096 x 128 embedding, 64 x 128 key/value projections below the
    4,096-value quantisation threshold, norms): plan's figure within 5% of the state a step creates."""
    cfg = resolve(
        load_config(
            None,
            [
                "--model.vocab_size=4096",
                "--model.n_kv_head=2",
                f"--optim.name={name}",
                "--train.max_steps=1000",
            ],
        )
    )
    planned = make_plan(cfg)["memory_per_gpu_bytes"]["optimizer"]
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ids = torch.randint(0, 4096, (2, 33))
    model(ids[:, :-1], ids[:, 1:])[1].backward()
    optimizer.step()
    measured = optimizer_state_bytes(optimizer)
    assert abs(planned / measured - 1) < 0.05, (planned, measured)
    params = sum(p.numel() for p in model.parameters())
    bytes_per_param = {"adamw": 8, "adamw8bit": 2, "adamw4bit": 1}[name]
    assert measured / params == pytest.approx(bytes_per_param, rel=0.12)  # what each is for


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", LOW_BIT)
def test_found_inf_skips_the_whole_update_and_state_round_trips_through_a_file(name, tmp_path):
    cfg = resolve(
        load_config(
            None,
            [
                "--model.vocab_size=512",
                "--model.d_model=64",
                "--model.n_layer=1",
                f"--optim.name={name}",
                "--train.max_steps=9",
            ],
        )
    )
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ids = torch.randint(0, 512, (2, 17))

    def step(found_inf: float) -> None:
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        optimizer.found_inf = torch.tensor(found_inf)
        optimizer.step()
        optimizer.zero_grad()

    step(0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = state_for_file(optimizer.state_dict())
    torch.save(saved, tmp_path / "optimizer.pt")
    step(1.0)  # flagged: nothing may change, not even the step count
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # plain tensors only: no pickled classes
    on_file = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    # every code, scale, table, fp32 moment, step and lr
    assert same(on_file, state_for_file(optimizer.state_dict()))
    loaded = state_from_file(on_file)
    # rebuilt as torchao's moments
    assert sum(is_quantised(v) for s in loaded["state"].values() for v in s.values()) >= 2
    assert same(state_for_file(loaded), on_file)
    step(0.0)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_torchao_the_error_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    monkeypatch.delitem(sys.modules, "pretrainer.optim.lowbit", raising=False)
    # else `from pretrainer.optim import lowbit` finds it
    monkeypatch.delattr(pretrainer.optim, "lowbit", raising=False)
    cfg = resolve(
        load_config(None, ["--model.vocab_size=256", "--optim.name=adamw8bit", "--train.max_steps=9"])
    )
    with pytest.raises(UserError, match=r"pip install -e '\.\[lowbit\]'"):
        build_optimizer(Transformer(cfg.model), cfg.optim, "cpu")
