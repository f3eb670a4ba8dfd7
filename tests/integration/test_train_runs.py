import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_subprocess, tiny_config, tiny_overrides
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pretrainer.artifacts.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_model_weights,
    model_weights,
    verify_checkpoint,
)
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import from_dict
from pretrainer.core.errors import UserError
from pretrainer.data.tokenizers.bpe import Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer
from pretrainer.model import Transformer
from pretrainer.model.generate import generate
from pretrainer.train.loop import train


def losses(run_dir: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "each step is logged exactly once"
    return {r["step"]: r["loss"] for r in records}


def test_loss_falls_on_the_stdlib_corpus(stdlib_data, tmp_path):
    settings = {"train.max_steps": 60, "train.micro_batch": 16, "optim.lr": 1e-2, "eval.every": 0}
    result = train(tiny_config(stdlib_data, tmp_path / "run", **settings))
    vals = [r["val_loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert vals[0] == pytest.approx(math.log(1024), abs=0.15)
    assert vals[-1] < vals[0] - 1.0, vals  # 30K tokens: past unigram statistics
    assert result["step"] == 60


def test_resume_is_bit_exact(stdlib_data, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_config(stdlib_data, straight))
    train(tiny_config(stdlib_data, split, **{"train.stop_at_step": 20}))
    assert max(losses(split)) == 20 and latest_checkpoint(split).name == "step-0000020"
    train(tiny_config(stdlib_data, split))  # same run dir, resume = auto
    expected, got = losses(straight), losses(split)
    assert list(expected) == list(range(1, 41))
    assert got == expected  # identical floats at every step, not merely close
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()
    assert final(straight) == final(split)


def single_file_copy(data: Path, out: Path) -> Path:
    """A copy of a one-shard data dir in the layout prepare wrote before shards (format v1): train.bin and
    val.bin, each split's file and checksums in the split itself."""
    shutil.copytree(data, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format"] = "pretrainer-tokens-v1"
    for split, info in manifest["splits"].items():
        (shard,) = info.pop("shards")
        (out / shard["file"]).rename(out / f"{split}.bin")
        info.update(file=f"{split}.bin", sha256=shard["sha256"], chunk_sha256=shard["chunk_sha256"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_sharded_data_trains_as_one_file_does_and_resumes_bit_exactly(stdlib_data, tmp_path):
    """The same tokens in 7 train shards and in a data dir from before shards: the same losses, step for
    step; a run on the shards stopped and resumed repeats them bit for bit."""
    from pretrainer.data.prepare import prepare
    from pretrainer.data.sources import Corpus

    sharded = tmp_path / "sharded"
    settings = dict(val_fraction=0.05, seed=0, max_docs=400, workers=1, shard_tokens=300_000)
    prepare(Corpus(["stdlib"]), "gpt2", sharded, tokenizer_from=str(stdlib_data), **settings)
    manifest = json.loads((sharded / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) == 7
    old = single_file_copy(stdlib_data, tmp_path / "old")
    assert (
        manifest["splits"]["train"]["sha256"]
        == json.loads((old / "manifest.json").read_text())["splits"]["train"]["sha256"]
    )
    short = {"train.max_steps": 20, "eval.every": 10}
    train(tiny_config(old, tmp_path / "on-old", **short))
    train(tiny_config(sharded, tmp_path / "on-shards", **short))
    train(tiny_config(sharded, tmp_path / "resumed", **short, **{"train.stop_at_step": 10}))
    train(tiny_config(sharded, tmp_path / "resumed", **short))
    expected = losses(tmp_path / "on-old")
    assert list(expected) == list(range(1, 21))
    assert losses(tmp_path / "on-shards") == expected == losses(tmp_path / "resumed")


def test_muon_learns_and_resumes_bit_exactly(stdlib_data, tmp_path):
    """optim.name = muon: one state dict (Muon's momentum, AdamW's moments, the momentum warm-up's step
    count) checkpointed and restored, so a stopped run continues with the same floats; and it learns."""
    muon = {"optim.name": "muon", "train.max_steps": 30, "eval.every": 30, "log.every": 2}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_config(stdlib_data, straight, **muon))
    train(tiny_config(stdlib_data, split, **muon, **{"train.stop_at_step": 10}))
    train(tiny_config(stdlib_data, split, **muon))
    expected, got = losses(straight), losses(split)
    assert list(expected) == list(range(2, 31, 2)) and got == expected
    final = lambda run: (latest_checkpoint(run) / "model.safetensors").read_bytes()
    assert final(straight) == final(split)
    assert expected[30] < expected[2] - 0.5, expected
    state = json.loads((latest_checkpoint(straight) / "state.json").read_text())
    assert state["optimizer"]["name"] == "muon"


def test_checkpoint_weights_reload_and_resave_byte_identically(stdlib_data, tmp_path):
    train(tiny_config(stdlib_data, tmp_path / "run", **{"train.max_steps": 10}))
    path = latest_checkpoint(tmp_path / "run") / "model.safetensors"
    state = json.loads((path.parent / "state.json").read_text())
    fresh = Transformer(from_dict(state["config"], "state.json").model)
    load_model_weights(fresh, load_file(path), str(path))
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    save_file(model_weights(fresh), tmp_path / "again.safetensors", metadata=metadata)
    assert (tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
    # and from other processes: string hashing, and so the order of a dict or set of names, differs
    # between them (two fixed seeds, each unlike this process's random one)
    script = (
        "import sys; from safetensors.torch import load_file, save_file; "
        "save_file(load_file(sys.argv[1]), sys.argv[2], metadata={'format': 'pt'})"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, path, tmp_path / f"other{seed}.safetensors"],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        for seed in (1, 2)
    ]
    # both at once: torch's import dominates
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    for seed in (1, 2):
        assert (tmp_path / f"other{seed}.safetensors").read_bytes() == path.read_bytes()


def test_checkpoints_are_complete_kept_to_n_and_torn_ones_ignored(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 30, "ckpt.keep": 2}))
    assert [p.name for p in list_checkpoints(run)] == ["step-0000020", "step-0000030"]
    for ckpt in list_checkpoints(run):
        assert {p.name for p in ckpt.iterdir()} == {
            "model.safetensors",
            "optimizer.pt",
            "state.json",
            "COMPLETE",
        }
    torn = run / "checkpoints" / "step-0000040"
    shutil.copytree(latest_checkpoint(run), torn)
    (torn / "COMPLETE").unlink()
    assert latest_checkpoint(run).name == "step-0000030"


def test_metrics_have_the_contract_keys_and_exact_tokens(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 12, "train.grad_accum": 2, "log.every": 4}))
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [4, 8, 12]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"} <= set(r)
        assert r["tokens"] == r["step"] * 8 * 64 * 2  # micro_batch x seq_len x grad_accum x 1 rank
    assert any("val_loss" in r and r["step"] == 12 for r in records)
    assert (run / "config.toml").is_file() and load_tokenizer(run / "tokenizer").vocab_size == 1024


def test_grad_accumulation_matches_a_larger_micro_batch(stdlib_data, tmp_path):
    train(tiny_config(stdlib_data, tmp_path / "a", **{"train.max_steps": 6, "train.micro_batch": 8}))
    train(
        tiny_config(
            stdlib_data,
            tmp_path / "b",
            **{"train.max_steps": 6, "train.micro_batch": 4, "train.grad_accum": 2},
        )
    )
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert a.keys() == b.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5)


def test_sample_cli_is_deterministic_and_greedy_matches_the_model(stdlib_data, tmp_path, run_cli):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 10}))
    args = (
        "sample",
        run,
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "30",
        "--seed",
        "3",
        "--device",
        "cpu",
    )
    first, second = run_cli(*args), run_cli(*args)
    assert first[0] == 0 and first[1] == second[1] and "def main(" in first[1]
    code, out, _ = run_cli(*args, "--temperature", "0")
    tok = load_tokenizer(run / "tokenizer")
    ckpt = latest_checkpoint(run)
    model = Transformer(from_dict(json.loads((ckpt / "state.json").read_text())["config"], "").model)
    load_model_weights(model, load_file(ckpt / "model.safetensors"), "")
    greedy = generate(model, torch.tensor([tok.encode("def main(")]), 30, temperature=0)
    assert tok.decode(greedy[0].tolist()) in out


# --- bad input to train: one line, exit code 2 ---


def test_missing_data_dir_and_unknown_key_are_one_line_errors(tmp_path, run_cli):
    """The whole process's stderr, under --nproc too: the data dir is checked before torchrun starts
    (each of its workers said it, then torchrun printed a traceback) and before the trainer's imports."""
    nowhere = tiny_overrides(tmp_path / "nope", tmp_path / "run")
    for nproc in ("1", "2"):
        result = run_subprocess("train", "--nproc", nproc, *nowhere)
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
        assert "nope: data dir not found; run `pretrainer prepare" in result.stderr
    code, _, err = run_cli("train", "--optim.lrr=1")
    assert (
        code == 2 and "unknown config key 'optim.lrr'; did you mean 'optim.lr' (peak learning rate)?" in err
    )
    assert not (tmp_path / "run").exists()


def test_vocab_mismatches_are_caught(stdlib_data, tmp_path, run_cli):
    code, _, err = run_cli(
        "train", *tiny_overrides(stdlib_data, tmp_path / "run", **{"model.vocab_size": 512})
    )
    assert code == 2 and "tokenizer/shard vocab mismatch" in err and "model.vocab_size = 512" in err
    swapped = tmp_path / "swapped"
    shutil.copytree(stdlib_data, swapped)
    other = Tokenizer("bpe:300", load_tokenizer(stdlib_data).pattern, {bytes([i]): i for i in range(256)})
    other.save(swapped)
    code, _, err = run_cli("train", *tiny_overrides(swapped, tmp_path / "run"))
    assert code == 2 and "tokenizer.json: tokenizer/shard vocab mismatch" in err
    assert not (tmp_path / "run").exists()


def test_activation_checkpointing_run_matches_a_plain_run(stdlib_data, tmp_path):
    train(tiny_config(stdlib_data, tmp_path / "plain", **{"train.max_steps": 5}))
    train(
        tiny_config(
            stdlib_data, tmp_path / "ckpt", **{"train.max_steps": 5, "train.activation_checkpointing": True}
        )
    )
    plain, checkpointed = losses(tmp_path / "plain"), losses(tmp_path / "ckpt")
    assert plain.keys() == checkpointed.keys()
    for step in plain:
        assert plain[step] == pytest.approx(checkpointed[step], abs=1e-5)


@pytest.mark.quiet  # compares wall-clock times
def test_periodic_checkpoints_are_written_while_training_goes_on(stdlib_data, tmp_path, monkeypatch):
    """A slow disk (each write 0.5 s): step 6 starts right after step 5's checkpoint was handed to the
    writer, not 0.5 s later; every checkpoint lands complete, and one written while the next steps changed
    the weights holds the step's own state: resuming from step 10 repeats steps 11-20 bit for bit."""
    import time

    from pretrainer.artifacts import checkpoint as checkpoint_files

    real = checkpoint_files._write_checkpoint_dir

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "_write_checkpoint_dir", slow)
    run = tmp_path / "run"
    settings = {"train.max_steps": 20, "ckpt.every": 5, "ckpt.keep": 10, "eval.every": 0, "log.every": 1}
    train(tiny_config(stdlib_data, run, **settings))
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert records[6]["elapsed_s"] - records[5]["elapsed_s"] < 0.25  # the write went on behind step 6
    assert [checkpoint_step(c) for c in list_checkpoints(run)] == [5, 10, 15, 20]
    assert all(verify_checkpoint(c) == "" for c in list_checkpoints(run))
    first = {step: r["loss"] for step, r in records.items()}
    monkeypatch.setattr(checkpoint_files, "_write_checkpoint_dir", real)
    train(tiny_config(stdlib_data, run, **settings, **{"train.resume": str(list_checkpoints(run)[1])}))
    again = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert again == first


def test_context_extension_resumes_with_the_optimizer_state_and_data_position(stdlib_data, tmp_path):
    """The llama3-1b recipe's 4096 phase, small: 20 steps at seq 32, then seq 64 at the same tokens per
    step. The resumed run's AdamW moments continue the first phase's (step counts go on, exp_avg keeps
    its direction), its data cursor is the same tokens, and its loss goes on from where it was."""
    run = tmp_path / "run"
    short = {
        "model.seq_len": 32,
        "train.micro_batch": 8,
        "train.max_steps": 30,
        "ckpt.every": 20,
        "eval.every": 0,
    }
    train(tiny_config(stdlib_data, run, **short, **{"train.stop_at_step": 20}))
    train(tiny_config(stdlib_data, run, **{**short, "model.seq_len": 64, "train.micro_batch": 4}))
    before = torch.load(run / "checkpoints/step-0000020/optimizer.pt", weights_only=True)["state"]
    after = torch.load(run / "checkpoints/step-0000030/optimizer.pt", weights_only=True)["state"]
    for key, moments in after.items():
        assert int(moments["step"]) == 30  # 20 carried + 10 new; a fresh optimizer would be at 10
        cosine = torch.nn.functional.cosine_similarity(
            moments["exp_avg_sq"].flatten(), before[key]["exp_avg_sq"].flatten(), dim=0
        )
        assert cosine > 0.5, (key, cosine)
    state = json.loads((run / "checkpoints/step-0000030/state.json").read_text())
    assert state["data"]["seq_len"] == 64 and state["data"]["cursor"] == 20 * 8 * 32 // 64 + 10 * 4
    loss = losses(run)
    assert list(loss) == list(range(1, 31))
    assert abs(loss[21] - sum(loss[k] for k in range(16, 21)) / 5) < 0.3  # no restart's jump at the switch
    # GPT-2's learned positions have no rows for the longer context: refused in one line
    gpt2 = tmp_path / "gpt2"
    gpt2_short = {**short, "model.arch": "gpt2", "model.n_kv_head": 0, "train.max_steps": 2, "ckpt.every": 0}
    train(tiny_config(stdlib_data, gpt2, **gpt2_short))
    with pytest.raises(UserError, match="model.seq_len = 32"):
        train(tiny_config(stdlib_data, gpt2, **{**gpt2_short, "model.seq_len": 64, "train.max_steps": 4}))
