"""Muon for the hidden matrices and AdamW for the rest (optim.name = muon): what each part updates, the
orthogonalisation, a skipped step, the batched step against one tensor at a time (its numbers and its
operator count), and plan's figures for its state and its FLOPs."""

import copy
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pretrainer.analysis.plan import make_plan
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.model import Transformer
from pretrainer.optim.muon import (
    MOMENTUM_WARMUP,
    NS_COEFFICIENTS,
    NS_STEPS,
    newton_schulz_flops,
    orthogonalise,
)
from pretrainer.optim.registry import build_optimizer, update_norm
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


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express"])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
def test_orthogonalise_leaves_singular_values_near_one(shape, method):
    """The quintic iteration trades exactness for speed: singular values spread over two decades land in
    about (0.5, 1.5) (Jordan's "US'V^T, S' ~ Uniform(0.5, 1.5)"), and the singular vectors are the
    input's."""
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(*shape), full_matrices=False)
    m = u @ torch.diag(torch.logspace(-2, 0, min(shape))) @ vh
    out = orthogonalise(m, method=method)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.5 and s.max() < 1.5, s
    if method == "polar_express":  # a coefficient set per step: it converges closer to 1
        assert s.min() > 0.75 and s.max() < 1.25, s
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


def test_cautious_weight_decay_decays_only_where_the_step_also_moves_towards_zero():
    """optim.cautious_weight_decay: a hidden weight whose update has the other sign keeps its value
    apart from the update; the others are decayed as before. Nothing else changes."""
    runs = {}
    for cautious in (False, True):
        cfg, model = tiny("llama", "--optim.weight_decay=0.5", f"--optim.cautious_weight_decay={cautious}")
        optimizer = build_optimizer(model, cfg.optim, "cpu")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        one_step(model, optimizer)
        runs[cautious] = {n: (before[n] - p.detach()) for n, p in model.named_parameters()}
    lr, wd = cfg.optim.lr, 0.5
    muon = [n for n in runs[False] if n.startswith("layers.") and before[n].dim() == 2]
    for name in muon:
        decay = lr * wd * before[name]
        step = runs[False][name] - decay  # the update alone
        towards_zero = step * before[name] >= 0
        expected = step + torch.where(towards_zero, decay, torch.zeros_like(decay))
        assert torch.allclose(runs[True][name], expected, atol=1e-7)
        assert 0 < towards_zero.float().mean() < 1  # both cases occur
    assert all(torch.equal(runs[True][n], runs[False][n]) for n in runs[False] if n not in muon)


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
    assert update_norm(optimizer).item() == 0.0
    optimizer.found_inf = torch.zeros(())
    one_step(model, optimizer, seed=1)
    moved = sum((p.detach() - before[n]).double().pow(2).sum() for n, p in model.named_parameters()).sqrt()
    assert update_norm(optimizer).item() == pytest.approx(moved.item(), rel=1e-4)


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


class OneAtATime(torch.optim.Optimizer):
    """The step as it was first written: one tensor at a time, the same formulas in the same order (the
    reference the batched step in optim/muon.py must equal)."""

    def __init__(self, groups, lr, betas, eps, momentum):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "momentum": momentum, "steps": 0})
        self.found_inf = None
        self.update_sq = []

    @torch.no_grad()
    def step(self):
        self.update_sq = []
        kept = None if self.found_inf is None else self.found_inf == 0
        for group in self.param_groups:
            group["steps"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    update = (self.muon if group["muon"] else self.adamw)(group, p, self.state[p], kept)
                    if kept is not None:
                        update = torch.where(kept, update, 0.0)
                    self.update_sq.append(update.float().pow(2).sum())
                    p.sub_(update)

    @staticmethod
    def orthogonalise(m):
        a, b, c = NS_COEFFICIENTS
        x = m.float()
        tall = x.size(0) > x.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=1e-7)
        for _ in range(NS_STEPS):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    def muon(self, group, p, state, kept):
        start, warmup_steps = MOMENTUM_WARMUP
        mu = start + (group["momentum"] - start) * min(1.0, group["steps"] / warmup_steps)
        buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
        buf.copy_(buf * mu + p.grad if kept is None else torch.where(kept, buf * mu + p.grad, buf))
        update = self.orthogonalise(p.grad.add(buf, alpha=mu)) * (group["lr"] * 0.2 * math.sqrt(max(p.shape)))
        return update + group["lr"] * group["weight_decay"] * p

    def adamw(self, group, p, state, kept):
        (beta1, beta2), lr = group["betas"], group["lr"]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] = state["step"] + (1 if kept is None else kept)
        exp_avg = state["exp_avg"].lerp(p.grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * p.grad * p.grad
        state["exp_avg"].copy_(exp_avg if kept is None else torch.where(kept, exp_avg, state["exp_avg"]))
        state["exp_avg_sq"].copy_(
            exp_avg_sq if kept is None else torch.where(kept, exp_avg_sq, state["exp_avg_sq"])
        )
        step = state["step"]
        denominator = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt() + group["eps"]
        update = lr * (state["exp_avg"] / (1 - beta1**step)) / denominator
        return update + lr * group["weight_decay"] * p


def pair(arch: str, *extra: str):
    """A model with the batched optimizer, and a copy of it with OneAtATime over the same groups."""
    cfg, model = tiny(arch, "--optim.weight_decay=0.1", *extra)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    twin = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {
            "params": [twin.get_parameter(names[id(p)]) for p in g["params"]],
            "muon": g["muon"],
            "weight_decay": g["weight_decay"],
        }
        for g in optimizer.param_groups
    ]
    o = cfg.optim
    return model, optimizer, twin, OneAtATime(groups, o.lr, (o.beta1, o.beta2), o.eps, o.muon_momentum)


def random_gradients(models, seed: int, scale: float = 1.0, nan: bool = False):
    generator = torch.Generator().manual_seed(seed)
    for named in zip(*(m.named_parameters() for m in models)):
        g = torch.randn(named[0][1].shape, generator=generator) * scale
        if nan:
            g.view(-1)[0] = float("nan")
        for _, p in named:
            p.grad = g.clone()


def snapshot(model, optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in model.parameters() for t in (p, *optimizer.state[p].values())]


@pytest.mark.parametrize(
    "arch, extra", [("llama", ()), ("gpt2", ()), ("llama", ("--model.tie_embeddings=false",))]
)
def test_the_batched_step_equals_one_tensor_at_a_time(arch, extra):
    """Several steps, kept and skipped (a skipped one with NaN or huge gradients): weights, momenta,
    moments and step counts equal the one-at-a-time reference to 1e-6 (on CPU they are bit for bit the
    same), the update norm too, and a skipped step leaves every tensor as it was, bit for bit."""
    model, optimizer, twin, reference = pair(arch, *extra)
    flags = [None, 0.0, 0.0, 1.0, 0.0, 1.0, None, 0.0]  # found_inf: None (no spike monitor), kept, skipped
    for step, flag in enumerate(flags):
        skipped = flag == 1.0
        random_gradients([model, twin], step, scale=1e4 if step == 3 else 1.0, nan=step == 5)
        before = snapshot(model, optimizer)
        optimizer.found_inf = reference.found_inf = None if flag is None else torch.tensor(flag)
        optimizer.step()
        reference.step()
        if skipped:
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
            assert update_norm(optimizer).item() == 0.0
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert (p - q).abs().max().item() <= 1e-6, (step, name)
            state, expected = optimizer.state[p], reference.state[q]
            assert state.keys() == expected.keys()
            for key in state:
                assert (state[key] - expected[key]).abs().max().item() <= 1e-6, (step, name, key)
        expected_norm = torch.stack(reference.update_sq).sum().sqrt().item()
        assert update_norm(optimizer).item() == pytest.approx(expected_norm, rel=1e-6, abs=1e-12)
    assert torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all()


def operators(optimizer) -> tuple[int, int]:
    """(every aten:: operator, the top-level ones) of one optimizer.step() (benchmarks/optimizer_ops.py)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(aten), len(top)


def test_the_step_issues_operators_per_shape_not_per_tensor():
    """The batched step's top-level operators depend on how many shapes the model has, not on its depth:
    the same count at 2 and 6 layers, under 400 (273 with torch 2.13). One tensor at a time issues over
    a thousand at 2 layers already (Muon: ~50 per matrix). All aten operators (those ops call inside
    themselves included: a _foreach op on CPU calls its per-tensor op once per tensor): under a fifth
    of one at a time's at 6 layers."""
    counts = {}
    for layers in (2, 6):
        model, optimizer, twin, reference = pair("llama", f"--model.n_layer={layers}")
        for step in range(3):  # the state exists after the first
            random_gradients([model, twin], step)
            optimizer.found_inf = reference.found_inf = torch.zeros(())
            if step < 2:
                optimizer.step()
                reference.step()
        counts[layers] = operators(optimizer), operators(reference)
    (all_2, top_2), (reference_all_2, reference_top_2) = counts[2]
    (all_6, top_6), (reference_all_6, reference_top_6) = counts[6]
    assert top_2 == top_6 < 400 < reference_top_2 < reference_top_6, counts
    assert all_6 < reference_all_6 / 5, counts


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_embedding_lr_scale_gives_the_embeddings_their_own_rate_and_nothing_else_changes(name):
    """optim.embedding_lr_scale: the token embedding (tied head) in a group of its own whose lr is the
    schedule's times the scale; at 1 the groups are as before the switch (old optimizer states load)."""
    from pretrainer.optim.schedule import set_lr

    _, model = tiny("llama", f"--optim.name={name}")
    plain = build_optimizer(
        model, tiny("llama", f"--optim.name={name}", "--optim.embedding_lr_scale=1")[0].optim, "cpu"
    )
    cfg, _ = tiny("llama", f"--optim.name={name}", "--optim.embedding_lr_scale=10")
    scaled = build_optimizer(model, cfg.optim, "cpu")
    assert len(scaled.param_groups) == len(plain.param_groups) + 1
    set_lr(scaled, 1e-3)
    embedding = model.wte.weight
    for group in scaled.param_groups:
        has_embedding = any(p is embedding for p in group["params"])
        assert group["lr"] == pytest.approx(1e-2 if has_embedding else 1e-3)
        assert not has_embedding or group["params"] == [embedding]


def test_the_recipe_s_embedding_lr_scale_is_muon_s_10_and_an_older_checkpoint_resumes_only_at_1(tmp_path):
    """optim.embedding_lr_scale = auto: 10 with Muon (the nanochat ablations), 1 with AdamW. A checkpoint
    saved before the key existed trained its embeddings in the common group: resuming it at another scale
    would not load its optimizer state, so it is refused with the flag that resumes it."""
    from pretrainer.config.keys import to_dict
    from pretrainer.config.resolve import resume_changes
    from pretrainer.core.errors import NotThisRun

    muon, _ = tiny("llama")
    assert muon.optim.embedding_lr_scale == 10.0
    assert tiny("llama", "--optim.name=adamw")[0].optim.embedding_lr_scale == 1.0
    old = to_dict(tiny("llama", "--optim.embedding_lr_scale=1")[0])
    del old["optim"]["embedding_lr_scale"]
    with pytest.raises(NotThisRun, match="resume with --optim.embedding_lr_scale=1.0"):
        resume_changes(muon, old, tmp_path, "pretrainer train ...")
    assert resume_changes(tiny("llama", "--optim.embedding_lr_scale=1")[0], old, tmp_path, "") == []
