"""8-bit and 4-bit AdamW (optim.name = adamw8bit | adamw4bit, torchao): they train, resume bit-exactly,
skip a flagged update as fused AdamW does, and plan's memory model predicts their state's size."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, tiny_overrides

import pretrainer.optim
from pretrainer.analysis.plan import make_plan
from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import load_config
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer
from pretrainer.optim.adamw import build_optimizer
from pretrainer.optim.sizes import is_quantised, optimizer_state_bytes
from pretrainer.optim.state_file import state_for_file, state_from_file
from pretrainer.train.loop import train

pytest.importorskip("torchao")
LOW_BIT = ["adamw8bit", "adamw4bit"]


def records(run_dir) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


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


@pytest.mark.slow
@pytest.mark.parametrize("name", LOW_BIT)
def test_low_bit_adamw_learns_as_adamw_does(name, stdlib_data, tmp_path):
    """40 steps of the tiny model (test_train's resume run), resumed halfway, against AdamW's run."""
    run = resumed_equals_straight(name, stdlib_data, tmp_path / name, 40)
    train(tiny_config(stdlib_data, tmp_path / "adamw"))
    val = lambda run: [r["val_loss"] for r in records(run) if "val_loss" in r]
    assert val(run)[-1] < val(run)[0] - 0.5, val(run)  # it learns
    # the stated tolerance (README, docs/benchmarks.md): within 3% of AdamW's final validation loss
    assert val(run)[-1] == pytest.approx(val(tmp_path / "adamw")[-1], rel=0.03), (
        val(run),
        val(tmp_path / "adamw"),
    )


@pytest.mark.parametrize("name", ["adamw", *LOW_BIT])
def test_plan_predicts_the_optimizer_state_bytes(name):
    """The quickstart's shapes (4,096 x 128 embedding, 64 x 128 key/value projections below the
    4,096-value quantisation threshold, norms): plan's figure within 5% of the state a step creates."""
    cfg = load_config(None, ["--model.vocab_size=4096", "--model.n_kv_head=2", f"--optim.name={name}"])
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
    cfg = load_config(
        None, ["--model.vocab_size=512", "--model.d_model=64", "--model.n_layer=1", f"--optim.name={name}"]
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
    on_file = torch.load(
        tmp_path / "optimizer.pt", weights_only=True
    )  # plain tensors only: no pickled classes
    assert same(
        on_file, state_for_file(optimizer.state_dict())
    )  # every code, scale, table, fp32 moment, step and lr
    loaded = state_from_file(on_file)
    assert (
        sum(is_quantised(v) for s in loaded["state"].values() for v in s.values()) >= 2
    )  # rebuilt as torchao's moments
    assert same(state_for_file(loaded), on_file)
    step(0.0)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_torchao_the_error_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    monkeypatch.delitem(sys.modules, "pretrainer.optim.lowbit", raising=False)
    monkeypatch.delattr(
        pretrainer.optim, "lowbit", raising=False
    )  # else `from pretrainer.optim import lowbit` finds it
    cfg = load_config(None, ["--model.vocab_size=256", "--optim.name=adamw8bit"])
    with pytest.raises(UserError, match=r"pip install 'pretrainer\[lowbit\]'"):
        build_optimizer(Transformer(cfg.model), cfg.optim, "cpu")


@pytest.mark.slow  # three 2-rank torchrun launches
def test_two_rank_ddp_resume_of_adamw8bit_is_bit_exact(stdlib_data, tmp_path):
    """The quantised moments cannot be broadcast as tensors: rank 0 sends their plain parts
    (distributed.py)."""
    from test_distributed import torchrun

    settings = {
        "optim.name": "adamw8bit",
        "parallel.strategy": "ddp",
        "train.micro_batch": 4,
        "train.max_steps": 8,
        "ckpt.every": 4,
        "eval.every": 0,
    }
    torchrun(2, *tiny_overrides(stdlib_data, tmp_path / "straight", **settings))
    torchrun(2, *tiny_overrides(stdlib_data, tmp_path / "split", **settings, **{"train.stop_at_step": 4}))
    torchrun(2, *tiny_overrides(stdlib_data, tmp_path / "split", **settings))
    loss = lambda run: {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert loss(tmp_path / "split") == loss(tmp_path / "straight") and len(loss(tmp_path / "straight")) == 8
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()
    assert final(tmp_path / "split") == final(tmp_path / "straight")
