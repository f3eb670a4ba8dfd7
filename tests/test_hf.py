"""Our models against implementations nobody on this project wrote (Hugging Face transformers),
and the export/import paths that rely on that agreement."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, tiny_overrides
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from pretrainer.artifacts import hf_format as hf
from pretrainer.artifacts.checkpoint import latest_checkpoint, model_weights
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.schema import ModelConfig
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.bpe import load_gpt2, train_bpe
from pretrainer.model import Transformer
from pretrainer.model.generate import generate
from pretrainer.train.loop import train

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
    ),
    "gpt2": dict(arch="gpt2", vocab_size=211, seq_len=96, d_model=64, n_layer=3, n_head=4),
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


@pytest.mark.parametrize("name", ["llama-gqa-tied", "gpt2"])
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
        again = hf.from_hf_weights(model.cfg, hf.to_hf_weights(model.cfg, weights), "test")
        assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)


# --- tokenizers ---

TEXTS = [
    "Hello world",
    "def main(argv):\n\treturn 0\n",
    "naïve café — 日本語 🙂",
    "   spaces   \n\n\n  x",
    "1234567 + 89",
]


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


# --- export and import through the CLI ---


def _sample_text(out: str) -> str:
    return out.split("--- sample 1 ---\n", 1)[1].rstrip("\n")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_train_export_load_generate_round_trip(arch, stdlib_data, tmp_path, run_cli):
    run = tmp_path / "run"
    extra = {"model.arch": arch, "train.max_steps": 30, "eval.every": 0}
    if arch == "gpt2":
        extra["model.n_kv_head"] = 0
    train(tiny_config(stdlib_data, run, **extra))
    code, out, err = run_cli("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model.generation_config.eos_token_id = None
    code, out, _ = run_cli(
        "sample",
        run,
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0",
        "--device",
        "cpu",
    )
    ids = tokenizer("def main(", return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(
        ids, max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0
    )
    assert tokenizer.decode(generated[0]) == _sample_text(out)


def test_weights_only_export_in_bf16_and_fp32(stdlib_data, tmp_path, run_cli):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 5}))
    original = load_file(latest_checkpoint(run) / "model.safetensors")
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = tmp_path / f"model-{dtype}.safetensors"
        assert run_cli("export", run, "--format", "safetensors", "--dtype", dtype, "--out", out)[0] == 0
        with safe_open(out, "pt") as f:
            meta = f.metadata()
        cfg = ModelConfig(**json.loads(meta["pretrainer_model_config"]))
        assert cfg.d_model == 64 and json.loads(meta["tokenizer"])["name"] == "bpe:1024"
        weights = load_file(out)
        assert weights.keys() == original.keys() and all(w.dtype == torch_dtype for w in weights.values())
        assert all(torch.equal(weights[k], original[k].to(torch_dtype)) for k in weights)


def test_init_from_a_transformers_gpt2_directory(stdlib_data, tmp_path, run_cli):
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(
        GPT2Config(vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    shape = {
        "model.arch": "gpt2",
        "model.n_kv_head": 0,
        "eval.every": 0,
        "train.max_steps": 10,
        "train.micro_batch": 4,
    }
    run = tmp_path / "run"
    code, out, err = run_cli(
        "train", *tiny_overrides(stdlib_data, run, **shape), f"--init.from=hf:{tmp_path / 'gpt2'}"
    )
    assert code == 0, err
    # The step-0 validation loss is the transformers model's own loss on the same batches.
    val0 = next(r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if r["step"] == 0)
    from pretrainer.data.loader import open_data_dir, validation_batches

    batches = validation_batches(open_data_dir(stdlib_data).tokens("val"), 64, 4, 4)
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in batches
        ]
    assert val0 == pytest.approx(sum(losses) / len(losses), abs=1e-4)
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 10

    code, out, err = run_cli(
        "eval",
        *tiny_overrides(stdlib_data, tmp_path / "unused", **shape),
        f"--init.from=hf:{tmp_path / 'gpt2'}",
    )
    assert code == 0 and re.search(r"val loss \d+\.\d{4}", out)


def test_init_from_with_shapes_that_do_not_fit_lists_them(stdlib_data, tmp_path, run_cli):
    GPT2LMHeadModel(
        GPT2Config(vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    code, _, err = run_cli(
        "train",
        *tiny_overrides(
            stdlib_data,
            tmp_path / "run",
            **{"model.arch": "gpt2", "model.n_kv_head": 0, "model.d_model": 32, "model.n_layer": 3},
        ),
        f"--init.from=hf:{tmp_path / 'gpt2'}",
    )
    assert code == 2 and err.count("\n") == 1
    assert (
        "model.d_model = 32 but the source has 64" in err and "model.n_layer = 3 but the source has 2" in err
    )
