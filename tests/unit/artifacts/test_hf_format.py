"""Our models against implementations nobody on this project wrote (Hugging Face transformers),
and the export/import paths that rely on that agreement."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.hf_tokenizer_helpers import TEXTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from pretrainer.artifacts import hf_format as hf
from pretrainer.artifacts import hf_import
from pretrainer.artifacts.checkpoint import model_weights
from pretrainer.config.schema import ModelConfig
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.bpe import load_gpt2, train_bpe
from pretrainer.model import Transformer
from pretrainer.model.generate import generate

SHAPES = {
    "llama-gqa-tied": dict(
        arch="llama",
        vocab_size=211,
        seq_len=96,
        d_model=64,
        n_layer=3,
        n_head=8,
        n_kv_head=2,
        d_ff=160,
        rope_theta=500000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm="false",
    ),
    "llama-mha-untied": dict(
        arch="llama",
        vocab_size=211,
        seq_len=96,
        d_model=48,
        n_layer=2,
        n_head=4,
        n_kv_head=0,
        tie_embeddings=False,
        qk_norm="false",
    ),
    # nanochat's QK-norm: exported as Qwen3 (q and k RMS-normed per head before RoPE)
    "llama-qk-norm-gqa": dict(
        arch="llama",
        vocab_size=211,
        seq_len=96,
        d_model=64,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        rope_theta=100000.0,
        norm_eps=1e-6,
        qk_norm="true",
    ),
    "llama-qk-norm-untied": dict(
        arch="llama",
        vocab_size=211,
        seq_len=96,
        d_model=48,
        n_layer=2,
        n_head=4,
        qk_norm="true",
        tie_embeddings=False,
    ),
    "gpt2": dict(arch="gpt2", vocab_size=211, seq_len=96, d_model=64, n_layer=3, n_head=4),
    # the DDP story's GPT-2: no q/k/v biases (exported as HF's zeros)
    "gpt2-no-qkv-bias": dict(
        arch="gpt2", vocab_size=211, seq_len=96, d_model=64, n_layer=2, n_head=4, qkv_bias="false"
    ),
    "gpt2-ffn": dict(
        arch="gpt2", vocab_size=211, seq_len=96, d_model=48, n_layer=2, n_head=6, d_ff=80, norm_eps=1e-6
    ),
}


def as_hf(model: Transformer, directory: Path):
    """Write config.json + model.safetensors exactly as `export --format hf` does, load with transformers."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(hf.hf_config(model.cfg, eot_id=model.cfg.vocab_size - 1))
    )
    save_file(
        hf.to_hf_weights(model.cfg, model_weights(model)),
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    return AutoModelForCausalLM.from_pretrained(
        directory, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


def ours(name: str, seed: int = 0, init_std: float = 0.02) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**SHAPES[name], init_std=init_std)).eval()


@pytest.mark.parametrize("name", SHAPES)
def test_logits_agree_with_transformers(name, tmp_path):
    model = ours(name)
    with torch.no_grad():  # non-trivial norm weights and biases, so a mapping mistake cannot hide
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    reference = as_hf(model, tmp_path)
    for batch, length in ((2, 96), (3, 17)):
        idx = torch.randint(0, 211, (batch, length))
        with torch.no_grad():
            expected = reference(idx).logits
            got, _ = model(idx)
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-qk-norm-gqa", "gpt2"])
def test_greedy_generation_is_identical(name, tmp_path):
    model = ours(name, init_std=0.2)  # peaked logits: ties are impossible to break by rounding
    reference = as_hf(model, tmp_path)
    reference.generation_config.eos_token_id = None  # generate exactly 50 tokens, as ours does
    reference.generation_config.pad_token_id = 0
    prompt = torch.randint(0, 211, (2, 6))
    mine = generate(model, prompt, 50, temperature=0)
    theirs = reference.generate(
        prompt, max_new_tokens=50, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    assert torch.equal(mine, theirs)


def test_import_round_trips_weights_exactly():
    for name in SHAPES:
        model = ours(name)
        weights = model_weights(model)
        again = hf_import.from_hf_weights(model.cfg, hf.to_hf_weights(model.cfg, weights), "test")
        assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)


# --- tokenizers ---


def tokenizers_under_test():
    docs = Corpus(["stdlib"]).documents()
    return {"gpt2": load_gpt2(), "bpe": train_bpe((next(docs) for _ in range(120)), 600)}


@pytest.fixture(scope="module")
def tokenizers():
    return tokenizers_under_test()


@pytest.mark.parametrize("kind", ["gpt2", "bpe"])
def test_exported_tokenizer_matches_ours(kind, tokenizers, tmp_path):
    tok = tokenizers[kind]
    hf.hf_tokenizer_files(tok, tmp_path, model_max_length=1024)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    source = Path(__import__("json").__file__).read_text()  # a real multi-kilobyte Python file
    for text in TEXTS + [source]:
        ids = tok.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs.decode(ids) == text == tok.decode(ids)
    assert theirs.eos_token_id == tok.eot_id
