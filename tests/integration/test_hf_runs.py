"""Our models against implementations nobody on this project wrote (Hugging Face transformers),
and the export/import paths that rely on that agreement."""

import json
import re

import pytest
import torch
from helpers import tiny_config, tiny_overrides
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.schema import ModelConfig
from pretrainer.train.loop import train

# --- export and import through the CLI ---


def _sample_text(out: str, eot: str = "<|endoftext|>") -> str:
    """The first sample's text as the tokenizer decodes it (`sample` puts each end-of-text on its own
    line, between the documents it separates)."""
    return out.split("--- sample 1 ---\n", 1)[1].replace(f"\n{eot}\n", eot).rstrip("\n")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_train_export_load_generate_round_trip(arch, stdlib_data, text_data, tmp_path, run_cli):
    """llama on a 300-token BPE, padded to 384 rows in training: the export has the tokenizer's 300
    and greedy decoding agrees with ours, which never picks a padding row."""
    run = tmp_path / "run"
    extra = {"model.arch": arch, "train.max_steps": 30, "eval.every": 0}
    if arch == "gpt2":
        extra["model.n_kv_head"] = 0
    train(tiny_config(stdlib_data if arch == "gpt2" else text_data, run, **extra))
    code, out, err = run_cli("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    trained_rows = load_file(latest_checkpoint(run) / "model.safetensors")["wte.weight"].shape[0]
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    assert (trained_rows, exported) == ((1024, 1024) if arch == "gpt2" else (384, 300))
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
    from pretrainer.data.data_dir import open_data_dir
    from pretrainer.data.loader import validation_batches

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
