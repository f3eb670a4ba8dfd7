"""On CPU: no host syncs outside logging steps, compiled and bf16 training that match eager
fp32, evaluation that does not recompile, the update/param ratio without a copy of the weights, and
the throughput watchdog. (GPU-only checks skip cleanly without CUDA.)"""

import pytest
import torch
from helpers import tiny_config


def test_update_norm_from_optimizer_state_equals_the_weights_difference(stdlib_data, tmp_path):
    """optim.adamw_update_norm (no weight copy) against the copy-and-subtract it replaced."""
    from pretrainer.artifacts.runs import build_model
    from pretrainer.config.resolve import resolve
    from pretrainer.optim.adamw import adamw_update_norm
    from pretrainer.optim.registry import build_optimizer

    cfg = resolve(tiny_config(stdlib_data, tmp_path / "run", **{"model.vocab_size": 1024}))
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ids = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1))
    for step in range(3):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (step + 1)
        before = [p.detach().clone() for p in model.parameters()]
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        expected = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
        assert torch.allclose(adamw_update_norm(optimizer), expected, rtol=1e-4), step
    assert adamw_update_norm(optimizer, torch.ones(())).item() == 0.0  # a skipped update moved nothing


def test_micro_batch_search_grows_then_bisects():
    from pretrainer.train.autobatch import largest_that_fits

    tried = []

    def fits(micro_batch):
        tried.append(micro_batch)
        return micro_batch <= 12

    assert largest_that_fits([1, 2, 3, 4, 6, 8, 12, 16, 24, 48], fits) == 12
    assert tried == [1, 2, 4, 8, 16, 12]  # small to large (doubling), one failure, then bisection
    assert (
        largest_that_fits([1, 2, 4], lambda b: True) == 4 and largest_that_fits([1, 2], lambda b: False) == 0
    )


def test_micro_batch_auto_under_a_simulated_memory_limit(stdlib_data, tmp_path, monkeypatch):
    """The real trial (full steps of the run's model, with its activation checkpointing) on CPU, where
    saving more activation bytes in a step than a set limit raises the out-of-memory error CUDA would.
    The search finds the largest divisor under the limit, and no try outlives its turn."""
    import weakref

    from pretrainer.config.resolve import resolve
    from pretrainer.train import autobatch

    cfg = resolve(
        tiny_config(
            stdlib_data,
            tmp_path / "run",
            **{"model.vocab_size": 1024, "train.activation_checkpointing": True},
        )
    )
    cpu, built, saved = torch.device("cpu"), [], {"bytes": 0, "limit": 0}
    real_transformer = autobatch.Transformer

    def tracked(model_cfg):
        model = real_transformer(model_cfg)
        # each step starts with nothing saved
        model.register_forward_pre_hook(lambda *_: saved.update(bytes=0))
        built.append(weakref.ref(model))
        return model

    def pack(tensor):
        saved["bytes"] += tensor.numel() * tensor.element_size()
        if saved["limit"] and saved["bytes"] > saved["limit"]:
            raise torch.OutOfMemoryError("simulated: over the limit")
        return tensor

    tried = []

    def fits(micro_batch):
        assert all(ref() is None for ref in built)  # the previous try left nothing behind
        tried.append(micro_batch)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return autobatch.trial_fits(cfg, micro_batch, cpu, None, print)

    monkeypatch.setattr(autobatch, "Transformer", tracked)
    step_bytes = []
    for micro_batch in (1, 2):
        assert fits(micro_batch)
        step_bytes.append(saved["bytes"])
    per_sequence = step_bytes[1] - step_bytes[0]
    saved["limit"] = step_bytes[0] + 5.5 * per_sequence  # room for 6.5 sequences
    tried.clear()
    assert autobatch.find_micro_batch(cfg, 24, cpu, None, say=print, fits=fits) == 6
    assert tried == [1, 2, 4, 8, 6]  # divisors of 24, doubling until 8 does not fit, then bisection
    assert all(ref() is None for ref in built)


SHAPES = [
    ("llama", 128, 2, 4, 2, 64, 1000),
    ("llama", 192, 3, 6, 2, 128, 3000),
    ("gpt2", 128, 2, 4, 0, 64, 1000),
    ("gpt2", 192, 3, 6, 0, 128, 3000),
]


@pytest.mark.parametrize("arch, d, layers, heads, kv_heads, seq_len, vocab", SHAPES)
def test_plan_memory_matches_what_a_step_keeps(arch, d, layers, heads, kv_heads, seq_len, vocab):
    """plan's memory model against a real CPU step in bf16 autocast: the bytes saved for the backward
    (activations, bf16 weight copies, the fused loss's output gradient: every tensor the autograd
    graph holds at the end of the forward) and the tensors alive then (weights, gradients from an
    earlier micro-step, AdamW moments), each within 10%."""
    from pretrainer.analysis.plan import make_plan
    from pretrainer.config.load import load_config
    from pretrainer.config.resolve import resolve
    from pretrainer.core.device import autocast
    from pretrainer.model import Transformer
    from pretrainer.optim.registry import build_optimizer

    micro_batch = 4
    cfg = load_config(
        None,
        [
            "--optim.name=adamw",  # the moments this test counts; Muon's state: tests/unit/optim/test_muon.py
            f"--model.arch={arch}",
            f"--model.d_model={d}",
            f"--model.n_layer={layers}",
            f"--model.n_head={heads}",
            f"--model.n_kv_head={kv_heads}",
            f"--model.seq_len={seq_len}",
            f"--model.vocab_size={vocab}",
            f"--train.micro_batch={micro_batch}",
            "--train.max_steps=1000",
        ],
    )
    memory = make_plan(cfg, gpus=1)["memory_per_gpu_bytes"]
    cfg = resolve(cfg)  # optim.lr = auto becomes a number
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ids = torch.randint(0, vocab, (micro_batch, seq_len + 1))
    model(ids[:, :-1], ids[:, 1:])[1].backward()
    optimizer.step()  # moments exist; gradients stay, as after an earlier micro-step of grad accumulation
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        autocast(torch.device("cpu"), torch.bfloat16),
    ):
        model(ids[:, :-1], ids[:, 1:])
    planned_saved = memory["activations"] + memory["bf16_weights"] + memory["loss_gradient"]
    assert abs(sum(saved.values()) / planned_saved - 1) < 0.10, (sum(saved.values()), planned_saved)
    states = sum(t.numel() * t.element_size() for p in model.parameters() for t in (p, p.grad))
    states += sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    planned_states = memory["weights"] + memory["gradients"] + memory["optimizer"]
    assert abs(states / planned_states - 1) < 0.10, (states, planned_states)
