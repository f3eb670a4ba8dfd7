"""The throughput and prepare-speed benchmarks run end to end in --smoke mode (the numbers are not
checked)."""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_forked

from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.data.data_dir import open_data_dir

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
    rows = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[2:] == ["| prepare, 1 worker", "| prepare, 2 workers", "| raw tiktoken, 2 threads"]
    assert "prepare at 2 workers / raw tiktoken at 2 threads:" in result.stdout
    assert "prepare at 2 workers / at 1 worker:" in result.stdout


def test_optimizer_ops_smoke():
    """The operator-count table on a tiny shape of the 124M config: every optimizer's rows."""
    shape = ["--model.d_model=64", "--model.n_head=4", "--model.n_layer=2", "--model.vocab_size=256"]
    config = BENCHMARKS.parent / "configs" / "gpt2-124m.toml"
    result = run_script("optimizer_ops.py", "--config", config, "--warmup", 1, "--time", 2, *shape)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split(" | ")[:2] for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        ["| muon", "None"],
        ["| muon", "0-d tensor"],
        ["| adamw", "None"],
        ["| adamw", "0-d tensor"],
        ["| adamw-foreach", "None"],
    ], result.stdout


def test_gpu_checklist_says_it_needs_a_gpu_on_cpu():
    result = run_script("gpu_checklist.py", "--data", "unused")
    assert result.returncode == 2 and "no CUDA device" in result.stdout


def test_gpu_checklist_dry_run_walks_every_stage_and_checks_its_commands(monkeypatch):
    """--dry-run on CPU: every stage with the commands it would run and what it measures, each
    pretrainer command's config and overrides read as the trainer reads them; a misspelt key is
    caught here, before any GPU time is spent."""
    import importlib.util

    result = run_script("gpu_checklist.py", "--data", "data/gpt2", "--dry-run")
    spec = importlib.util.spec_from_file_location("gpu_checklist", BENCHMARKS / "gpu_checklist.py")
    checklist = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_checklist", checklist)  # its dataclasses look themselves up there
    spec.loader.exec_module(checklist)
    assert result.returncode == 0, result.stdout[-3000:]
    for stage in checklist.STAGES:
        estimate = f"~{stage.estimate_s} s"
        assert (
            f"{stage.name} (>= {stage.gpus} GPU, {estimate}): would measure {stage.measures}" in result.stdout
        )
    assert (
        f"dry run: {len(checklist.STAGES)} stages, 0 with a command the trainer would refuse" in result.stdout
    )
    assert (
        "--train.deterministic=true" in result.stdout
        and "--nproc 8 --parallel.strategy=fsdp" in result.stdout
    )
    typo = checklist.train("RUNS/x", "--data.dir=d", "--train.max_step=5", "--nproc", "2")
    assert "unknown config key 'train.max_step'" in checklist.check_command(typo)
    assert checklist.check_command(checklist.train("RUNS/x", "--train.max_steps=5", "--nproc", "2")) == ""


# nanoGPT's train.py stand-ins for vs_nanogpt.py: one fails, one logs evaluations as nanoGPT does
FAILING_NANOGPT = (
    "import sys; print('RuntimeError: CUDA error: an illegal memory access', file=sys.stderr); sys.exit(3)"
)
EVALUATING_NANOGPT = """
import sys
settings = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
for step in range(0, int(settings["max_iters"]) + 1, int(settings["eval_interval"])):
    print(f"step {step}: train loss 5.0, val loss {6 - step / 100:.4f}")
"""


@pytest.mark.parametrize("side", ["nanoGPT", "pretrainer"])
def test_vs_nanogpt_shows_what_the_failing_side_printed(side, stdlib_data, tmp_path):
    """Whichever side fails, the benchmark ends with its exit code and the end of its output, not a
    bare CalledProcessError (pretrainer's side fails here on a config it refuses)."""
    (tmp_path / "train.py").write_text(FAILING_NANOGPT if side == "nanoGPT" else EVALUATING_NANOGPT)
    (tmp_path / "model.py").write_text("")
    (tmp_path / "configurator.py").write_text("")
    result = run_script(
        "vs_nanogpt.py",
        "--data",
        stdlib_data,
        "--nanogpt",
        tmp_path,
        "--sizes",
        "64x1",
        "--horizons",
        "8",
        "--evals",
        "2",
        "--optim.lr=-1",
    )
    out = result.stdout + result.stderr  # (a forked run's streams are one)
    expected = "CUDA error: an illegal memory access" if side == "nanoGPT" else "optim.lr"
    assert result.returncode == 1 and f"error: {side} failed (exit" in out and expected in out, out[-3000:]


def test_checklist_commands_keep_the_callers_pythonpath(monkeypatch, tmp_path):
    """Packages brought as wheels with `pip install --target DIR` live on PYTHONPATH: a stage's commands
    see them (after the tree's own src), as the checklist's caller does."""
    spec = importlib.util.spec_from_file_location("gpu_checklist", BENCHMARKS / "gpu_checklist.py")
    checklist = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_checklist", checklist)
    spec.loader.exec_module(checklist)
    (tmp_path / "carried_wheel.py").write_text("NAME = 'carried'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    outcome = checklist.run_command(
        checklist.Command(
            [sys.executable, "-c", "import carried_wheel, pretrainer; print(carried_wheel.NAME)"]
        )
    )
    assert outcome.code == 0 and outcome.out.strip() == "carried", outcome.out
