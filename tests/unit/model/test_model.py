import math

import pytest
import torch

from pretrainer.config.schema import ModelConfig
from pretrainer.model import Transformer, count_parameters
from pretrainer.model.generate import generate


def meta_model(**kw) -> Transformer:
    with torch.device("meta"):  # count parameters of large shapes without allocating them
        return Transformer(ModelConfig(**kw))


def test_parameter_counts_match_published_shapes():
    x1 = meta_model(
        arch="llama",
        vocab_size=50257,
        seq_len=1024,
        d_model=768,
        n_layer=8,
        n_head=12,
        n_kv_head=4,
        d_ff=2048,
    )
    assert count_parameters(x1) == {"total": 88_942_080, "non_embedding": 50_344_704}
    gpt2 = meta_model(arch="gpt2", vocab_size=50257, seq_len=1024, d_model=768, n_layer=12, n_head=12)
    assert count_parameters(gpt2)["total"] == 124_439_808
    llama3 = meta_model(
        arch="llama",
        vocab_size=131072,
        seq_len=2048,
        d_model=2048,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        d_ff=8192,
    )
    assert count_parameters(llama3)["total"] == 1_241_581_568


def test_untied_head_counts_as_non_embedding():
    tied = meta_model(vocab_size=1000, d_model=64, n_layer=2, n_head=4)
    untied = meta_model(vocab_size=1000, d_model=64, n_layer=2, n_head=4, tie_embeddings=False)
    assert count_parameters(untied)["non_embedding"] - count_parameters(tied)["non_embedding"] == 1000 * 64


CONFIGS = [
    dict(arch="llama", vocab_size=97, seq_len=32, d_model=48, n_layer=2, n_head=6, n_kv_head=2),
    dict(arch="llama", vocab_size=97, seq_len=32, d_model=48, n_layer=2, n_head=4, tie_embeddings=False),
    dict(arch="gpt2", vocab_size=97, seq_len=32, d_model=48, n_layer=2, n_head=4),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=["llama-gqa", "llama-untied", "gpt2"])
def test_kv_cache_decoding_equals_full_forward(kw):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**kw)).eval()
    idx = torch.randint(0, 97, (3, 20))
    full, _ = model(idx)
    cache = model.new_kv_cache(3)
    prefix, _ = model(idx[:, :8], kv_cache=cache)
    steps = [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(8, 20)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", CONFIGS, ids=["llama-gqa", "llama-untied", "gpt2"])
def test_causal_and_initial_loss_near_uniform(kw):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**kw)).eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    a, _ = model(idx)
    no_logits, loss = model(idx, torch.randint(0, 97, (2, 16)))
    b, _ = model(changed)
    assert no_logits is None  # with targets only the loss: the logits are never kept
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert abs(loss.item() - math.log(97)) < 0.1  # small init -> near-uniform predictions


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=256, n_layer=8, n_head=4))
    assert abs(model.layers[0].attn.q_proj.weight.std().item() - 0.02) < 0.002
    assert abs(model.layers[0].mlp.down_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.001


def test_greedy_generation_with_cache_equals_recomputation():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CONFIGS[0])).eval()
    prompt = torch.randint(0, 97, (2, 5))
    out = generate(model, prompt, 40, temperature=0)  # runs past seq_len 32: exercises the window refill
    assert out.shape == (2, 45)
    ids = prompt
    with torch.no_grad():
        while ids.size(1) < 32:  # reference: recompute the whole context for every token, no cache
            logits, _ = model(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out[:, :32], ids)  # identical while the context fits


def test_sampling_is_deterministic_given_a_seed():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CONFIGS[2])).eval()
    prompt = torch.randint(0, 97, (2, 4))
    runs = [
        generate(model, prompt, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])
    other = generate(model, prompt, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(runs[0], other)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_fused_chunked_loss_matches_cross_entropy_of_full_logits(dtype, monkeypatch):
    """model/loss.py against F.cross_entropy(linear(h).float()): the loss and both gradients, over
    several chunks (forced small), with ignored targets, in fp32 and under bf16 autocast."""
    import torch.nn.functional as F

    from pretrainer.model import loss as fused

    # 7 tokens per chunk at vocab 50: 5 chunks of 32 tokens
    monkeypatch.setattr(fused, "LOSS_CHUNK_ELEMENTS", 7 * 50)
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, 24, requires_grad=True)
    weight = (0.3 * torch.randn(50, 24)).requires_grad_()
    targets = torch.randint(0, 50, (2, 16))
    targets[0, :5] = fused.IGNORE_INDEX
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        expected = F.cross_entropy(
            F.linear(hidden, weight).float().flatten(0, 1), targets.flatten(), ignore_index=fused.IGNORE_INDEX
        )
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        got = fused.linear_cross_entropy(hidden, weight, targets)
    got_grads = torch.autograd.grad(2.0 * got, (hidden, weight))  # the incoming gradient scales both
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if dtype else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, expected, **tolerance)
    for g, e in zip(got_grads, expected_grads):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, 2.0 * e, **tolerance)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        # evaluation: the same loss, no gradient work
        evaluated = fused.linear_cross_entropy(hidden, weight, targets)
    assert evaluated.grad_fn is None
    torch.testing.assert_close(evaluated, got.detach(), rtol=1e-6, atol=1e-6)


class LiveBytes:
    """Bytes of the tensors torch ops create, alive at once: a CPU stand-in for CUDA's
    max_memory_allocated (a dispatch mode sees every op's outputs; each is counted until freed)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.numel():
                        meter.created(t)
                return out

        self.mode, self.live, self.peak, self.storages = Mode(), 0, 0, set()

    def created(self, t: torch.Tensor) -> None:
        import weakref

        storage = t.untyped_storage()
        if storage.data_ptr() in self.storages:  # a view of one counted already
            return
        self.storages.add(storage.data_ptr())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self.freed, storage.data_ptr(), storage.nbytes())

    def freed(self, pointer: int, nbytes: int) -> None:
        self.storages.discard(pointer)
        self.live -= nbytes


def test_fused_loss_keeps_one_chunk_of_logits_alive(monkeypatch):
    """The previous chunk's logits and gradients are freed before the next chunk's are made: besides
    the gradients it returns (hidden's and the weight's), the loss holds less than two chunks of fp32
    logits at its peak (with both alive it held ~2.8)."""
    from pretrainer.model import loss

    vocab, d, tokens = 512, 32, 1024
    monkeypatch.setattr(loss, "LOSS_CHUNK_ELEMENTS", 128 * vocab)  # 8 chunks of 128 tokens
    torch.manual_seed(0)
    hidden = torch.randn(tokens, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    meter = LiveBytes()
    with meter.mode:
        loss.linear_cross_entropy(hidden, weight, targets)
    chunk_logits, returned_gradients = 128 * vocab * 4, (tokens * d + vocab * d) * 4
    assert meter.peak - returned_gradients < 2 * chunk_logits, meter.peak


def test_casting_the_weights_keeps_the_rope_tables_in_fp32():
    """serve-cost's bf16 variant and .half() cast the weights; the RoPE tables stay fp32, as training
    keeps them under autocast (rounded to bf16 a position's angle is off by up to ~0.4%)."""
    model = Transformer(ModelConfig(vocab_size=64, seq_len=512, d_model=32, n_layer=1, n_head=2, d_ff=64))
    cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
    model.to(torch.bfloat16)
    assert model.wte.weight.dtype == torch.bfloat16
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    model.to(device="meta")
    assert model.rope_cos.device.type == "meta" and model.rope_cos.dtype == torch.float32


def test_document_masks_through_flex_attention_match_the_sdpa_mask():
    """data.packing = document: the BlockMask path (flex_attention, what CUDA runs: block-sparse, with
    grouped K/V heads read natively) gives the SDPA mask's per-token losses (forward only: flex has no
    CPU backward; the GPU checklist's packing stage trains with it); the start-up probe names the kernel
    the run's own mask gets."""
    import warnings

    from pretrainer.model.attention_probe import attention_backend

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, seq_len=48, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 63, (2, 49))
    ids[0, [7, 30]], ids[1, 20] = 63, 63  # end-of-text 63: three documents in row 0, two in row 1
    losses = []
    for flex in (False, True):
        model.flex_documents = flex
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on CPU says it is unfused
            losses.append(model(ids[:, :-1], ids[:, 1:], per_token=True, doc_separator=63)[0])
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    model.flex_documents = False
    # flex is judged by a compiled forward and backward outside any dispatch mode: here, no CPU backward
    from pretrainer.model.attention_probe import flex_attention_problem

    assert "backward on CPU" in flex_attention_problem(cfg, torch.device("cpu"), None)
    # probed with the run's own mask (CPU's flash kernel takes one; CUDA's flash kernels do not)
    assert attention_backend(model, 48, torch.device("cpu"), None, documents=True) == "flash (document mask)"
