"""The throughput and prepare-speed benchmarks run end to end in --smoke mode (the numbers are not
checked)."""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

from helpers import run_forked

from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.data.loader import open_data_dir

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Stands in for nanoGPT's train.py (nanoGPT is never part of this repo): checks what the benchmark
# set up and prints nanoGPT's log line with 10 ms per iteration, so the nanoGPT row's tokens/s is known.
FAKE_NANOGPT_TRAIN = """
import pickle, sys
settings = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
assert open(f"data/{settings['dataset']}/train.bin", "rb").read(2)
assert pickle.load(open(f"data/{settings['dataset']}/meta.pkl", "rb"))["vocab_size"] == 1024
for i in range(int(settings["max_iters"]) + 1):
    print(f"iter {i}: loss 6.9000, time 10.00ms, mfu -100.00%")
"""


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    """A benchmark script as `python SCRIPT ARGS` runs it, in a process forked from this one."""
    return run_forked(_script_main, BENCHMARKS / name, [str(a) for a in args], timeout=300)


def _script_main(script, args: list[str]):
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def test_throughput_smoke(stdlib_data, tmp_path):
    """One process: bare loop, trainer and (a stand-in) nanoGPT, a combined variant, two micro-batches."""
    (tmp_path / "train.py").write_text(FAKE_NANOGPT_TRAIN)
    (tmp_path / "model.py").write_text("")
    (tmp_path / "configurator.py").write_text("")
    result = run_script(
        "throughput.py",
        "--smoke",
        "--data",
        stdlib_data,
        "--model.arch=gpt2",
        "--nanogpt",
        tmp_path,
        "--out",
        tmp_path / "results.json",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for variant in ("config", "ac+sdpa-math"):
        for loop in ("bare loop", "pretrainer"):
            for micro_batch in (2, 4):
                assert f"| {loop} | {variant} | {micro_batch} |" in result.stdout
    assert "| nanoGPT | config | 2 | 6,400 |" in result.stdout  # 2 sequences x 32 tokens per 10 ms
    # nanoGPT has no activation checkpointing
    assert "| nanoGPT | ac+sdpa-math | 2 | skipped |" in result.stdout
    assert "pretrainer / bare loop" in result.stdout and "pretrainer / nanoGPT" in result.stdout
    if "cuda" not in result.stdout:
        assert "| bare loop | sdpa-efficient | 2 | skipped |" in result.stdout  # no such kernel on CPU
    assert (tmp_path / "results.json").is_file()


def test_nanogpt_needs_the_gpt2_shape(stdlib_data):
    spec = importlib.util.spec_from_file_location("throughput", BENCHMARKS / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    data = open_data_dir(stdlib_data)
    llama = resolve(load_config(None, [f"--data.dir={stdlib_data}"]), 1, data, horizon=False)
    assert "--model.arch=gpt2" in throughput.nanogpt_problem(llama, data)
    gpt2 = resolve(
        load_config(None, [f"--data.dir={stdlib_data}", "--model.arch=gpt2"]), 1, data, horizon=False
    )
    assert throughput.nanogpt_problem(gpt2, data) == ""


def test_prepare_speed_smoke():
    result = run_script("prepare_speed.py", "--smoke", "--workers", 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| pretrainer prepare |" in result.stdout and "| raw tiktoken |" in result.stdout
    assert "pretrainer / raw tiktoken" in result.stdout


def test_gpu_checklist_says_it_needs_a_gpu_on_cpu():
    result = run_script("gpu_checklist.py", "--data", "unused")
    assert result.returncode == 2 and "no CUDA device" in result.stdout


def test_task_accuracy_agrees_with_lm_evaluation_harness(stdlib_data, tmp_path):
    """our multiple-choice accuracies on an exported model equal lm-eval's on the same items
    (a local task) within 0.5 points, and each choice's log-likelihood to 1e-3. Needs lm_eval (any
    environment: LM_EVAL=/path/to/lm_eval); docs/benchmarks.md records a run on the quickstart model."""
    import json
    import os
    import random
    import re
    import shutil

    import pytest
    import torch

    from pretrainer.artifacts.checkpoint import model_weights
    from pretrainer.artifacts.hf_format import export_hf
    from pretrainer.config.schema import ModelConfig
    from pretrainer.model import Transformer

    lm_eval = os.environ.get("LM_EVAL") or shutil.which("lm_eval")
    if not lm_eval:
        pytest.skip(
            "lm-eval is not installed (pip install 'lm-eval[hf]' anywhere, then LM_EVAL=/path/to/lm_eval)"
        )
    tokenizer = open_data_dir(stdlib_data).tokenizer
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=tokenizer.vocab_size, seq_len=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    )
    export_hf(model.cfg, model_weights(model), tokenizer, tmp_path / "hf")
    rng = random.Random(0)
    words = [
        "return",
        "self",
        "value",
        "import",
        "None",
        "list",
        "dict",
        "error",
        "print",
        "class",
        "yield",
        "lambda",
    ]
    items = [
        {
            "type": "mc",
            "context": f"def f{i}(x):\n    " + " ".join(rng.choices(words, k=rng.randrange(2, 8))),
            "choices": [" " + " ".join(rng.choices(words, k=rng.randrange(1, 4))) for _ in range(4)],
            "gold": rng.randrange(4),
        }
        for i in range(200)
    ]
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    done = run_script(
        "lm_eval_agreement.py",
        tmp_path / "hf",
        "--task",
        tmp_path / "toy.jsonl",
        "--limit",
        "0",
        "--data-dir",
        stdlib_data,
        "--lm-eval",
        lm_eval,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = [float(x) for x in re.findall(r"^acc(?:_norm)?\s+\S+\s+\S+\s+([+-][\d.]+)$", done.stdout, re.M)]
    assert len(diffs) == 2 and all(abs(d) <= 0.5 for d in diffs), done.stdout
    assert float(re.search(r"log-likelihood ours - lm-eval\|: max (\S+),", done.stdout).group(1)) < 1e-3
