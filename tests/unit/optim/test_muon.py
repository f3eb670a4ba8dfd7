"""Muon for the hidden matrices and AdamW for the rest (optim.name = muon): what each part updates, the
orthogonalisation, a skipped step, and plan's figures for its state and its FLOPs."""

import pytest
import torch

from pretrainer.analysis.plan import make_plan
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.model import Transformer
from pretrainer.optim.adamw import adamw_update_norm, build_optimizer
from pretrainer.optim.muon import newton_schulz_flops, orthogonalise
from pretrainer.optim.sizes import optimizer_state_bytes


def tiny(arch: str, *extra: str):
    cfg = resolve(
        load_config(
            None,
            [
                f"--model.arch={arch}",
                "--model.vocab_size=256",
                "--model.d_model=64",
                "--model.n_layer=2",
                "--model.n_head=4",
                "--model.seq_len=32",
                "--optim.name=muon",
                "--train.max_steps=100",
                *extra,
            ],
        )
    )
    torch.manual_seed(0)
    return cfg, Transformer(cfg.model)


def one_step(model, optimizer, seed: int = 0):
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))
    model(ids[:, :-1], ids[:, 1:])[1].backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
def test_orthogonalise_leaves_singular_values_near_one(shape):
    """The quintic iteration trades exactness for speed: singular values spread over two decades land in
    about (0.5, 1.5) (Jordan's "US'V^T, S' ~ Uniform(0.5, 1.5)"), and the singular vectors are the
    input's."""
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(*shape), full_matrices=False)
    m = u @ torch.diag(torch.logspace(-2, 0, min(shape))) @ vh
    out = orthogonalise(m)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.5 and s.max() < 1.5, s
    # the same directions: out = u diag(s') vh with s' the new singular values, in the input's order
    s_in_order = (u.T @ out @ vh.T).diagonal()
    assert torch.allclose(u @ torch.diag(s_in_order) @ vh, out, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_muon_updates_the_hidden_matrices_and_adamw_the_rest(arch):
    cfg, model = tiny(arch)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in muon}
    assert names and all(model.get_parameter(n).dim() == 2 for n in names)
    assert not any(n.startswith(("wte", "wpe", "lm_head")) for n in names)
    assert any("attn" in n for n in names) and any("mlp" in n for n in names)
    one_step(model, optimizer)
    for p in model.parameters():
        state = optimizer.state[p]
        assert set(state) == ({"momentum_buffer"} if id(p) in muon else {"step", "exp_avg", "exp_avg_sq"})


def test_a_skipped_step_changes_nothing_and_the_update_norm_is_what_moved():
    cfg, model = tiny("llama")
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    one_step(model, optimizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    optimizer.found_inf = torch.ones(())
    one_step(model, optimizer, seed=1)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(
        torch.equal(moments[n][k], v)
        for n, p in model.named_parameters()
        for k, v in optimizer.state[p].items()
    )
    assert adamw_update_norm(optimizer).item() == 0.0
    optimizer.found_inf = torch.zeros(())
    one_step(model, optimizer, seed=1)
    moved = sum((p.detach() - before[n]).double().pow(2).sum() for n, p in model.named_parameters()).sqrt()
    assert adamw_update_norm(optimizer).item() == pytest.approx(moved.item(), rel=1e-4)


def test_plan_counts_muons_state_and_its_orthogonalisation_flops():
    cfg, model = tiny("llama", "--train.micro_batch=2")
    plan = make_plan(cfg)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    one_step(model, optimizer)
    planned, measured = plan["memory_per_gpu_bytes"]["optimizer"], optimizer_state_bytes(optimizer)
    assert abs(planned / measured - 1) < 0.01, (planned, measured)
    hidden = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    expected = sum(newton_schulz_flops(tuple(p.shape)) for p in hidden) / plan["tokens_per_step"]
    assert plan["flops_per_token_terms"]["optimizer"] == pytest.approx(expected)
    adamw = make_plan(
        load_config(
            None,
            [
                f"--{k}={v}"
                for k, v in {
                    "model.vocab_size": 256,
                    "model.d_model": 64,
                    "model.n_layer": 2,
                    "model.n_head": 4,
                    "model.seq_len": 32,
                    "train.max_steps": 100,
                    "train.micro_batch": 2,
                    "optim.name": "adamw",
                }.items()
            ],
        )
    )
    assert plan["flops_per_token"] == pytest.approx(adamw["flops_per_token"] + expected)
