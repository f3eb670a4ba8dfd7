"""A GPU node's first call, on CPU: a site image (torch and what such a node preinstalls, nothing of
pretrainer's own extras) where pretrainer imports and runs; the documented offline install from a
wheelhouse made by the documented command; and the first call's dry run in that image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.site_image import ABSENT, importable, make_site_image

ROOT = Path(__file__).resolve().parents[2]
# in one process of the image: every module imported, --help, and a verb that needs an absent package
WITHOUT_THE_EXTRAS = """
import contextlib, importlib, io, pkgutil, sys, pretrainer
from pretrainer.cli.main import main
from pretrainer.core.errors import UserError
for module in pkgutil.walk_packages(pretrainer.__path__, "pretrainer."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except UserError as e:  # a module that exists to wrap an extra says so in one line
        assert "pip install" in str(e), (module.name, e)
print("imported every module")
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as help:
    main(["--help"])
assert "prepare" in help.getvalue(), help.getvalue()
argv = ["prepare", "--corpus", "stdlib", "--tokenizer", "bpe:300", "--out", sys.argv[1]]
print("prepare exited", main(argv))
"""


@pytest.fixture(scope="module")
def site_image(tmp_path_factory) -> Path:
    python = make_site_image(tmp_path_factory.mktemp("site") / "venv")
    assert importable(python, ABSENT) == []  # as on the node
    return python


def run(python: Path, *args, env=None) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository's root, with `env` on top of this process's environment."""
    return subprocess.run(
        [str(python), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_every_module_imports_and_the_cli_answers_without_the_extras(site_image, tmp_path):
    """mlflow, wandb, torchao, gguf, zstandard, rustbpe and tomli-w absent: every module imports (those
    that wrap an extra say which in one line), --help answers, and a verb that needs one of them says
    so in one line and writes nothing."""
    out = tmp_path / "never-written"
    result = run(site_image, "-c", WITHOUT_THE_EXTRAS, out, env={"PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 0 and "imported every module" in result.stdout, result.stderr[-3000:]
    assert "prepare exited 2" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: prepare: this needs the Python package rustbpe, which is not installed here")
    ), result.stderr[-2000:]
    assert not out.exists()


def test_the_offline_install_then_prepare_plan_train_and_the_first_call_dry_run(site_image, tmp_path):
    """The wheelhouse for this image (its size printed, under 16 MiB), installed with pip --no-index;
    --help from the entry point it wrote; benchmarks/gpu_first_call.sh --dry-run (its data phase:
    prepare with GPT-2's BPE); plan and 4 steps of train (which writes its config.toml without
    tomli-w), all in the image."""
    wheels = tmp_path / "wheels"
    made = subprocess.run(
        [sys.executable, ROOT / "scripts" / "wheelhouse.py", "--out", wheels, "--have-python", site_image],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    total = made.stdout.strip().splitlines()[-1]
    assert "MiB  in" in total and float(total.split()[0]) < 16, made.stdout
    names = sorted(w.name.split("-")[0] for w in wheels.glob("*.whl"))
    assert names == ["gguf", "rustbpe", "setuptools", "zstandard"], names  # nothing the image has

    installed = run(site_image, "-m", "pip", "install", "--no-index", "--find-links", wheels, "-e", ".")
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    assert importable(site_image, ABSENT) == ["gguf", "zstandard", "rustbpe"]
    pretrainer = site_image.parent / "pretrainer"  # the entry point the install wrote
    helped = subprocess.run([pretrainer, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert helped.returncode == 0 and "prepare" in helped.stdout, helped.stderr

    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "nanogpt").mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py"):  # carried files are looked for, not run
        (cache / "nanogpt" / name).write_text("")
    call = subprocess.run(
        ["sh", "benchmarks/gpu_first_call.sh", out, "--dry-run", "--work", tmp_path / "work"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHON": str(site_image), "FIRST_CALL_CACHE": str(cache)},
    )
    assert call.returncode == 0, call.stdout[-4000:] + call.stderr[-2000:]
    table = (out / "first-call.md").read_text()
    for phase in ("env", "data"):
        assert f"| {phase} | PASS |" in table, table
    for stage in ("compiled_bf16", "speed_vs_nanogpt", "resume", "quality_vs_nanogpt", "muon_step"):
        assert f"| {stage} | planned |" in table, table
    plan = next(line for line in call.stdout.splitlines() if line.startswith("plan: "))
    assert int(plan.split("~")[1].split()[0]) <= 530, plan
    assert {p.name for p in out.iterdir()} == {
        "first-call.md",
        "first-call.json",
        "log.txt",
        "pip-freeze.txt",
    }

    # the dry run's data phase prepared the stdlib with GPT-2's BPE there, in the image: plan and train on it
    data, run_dir = tmp_path / "work" / "data", tmp_path / "run"
    tiny = ["--model.d_model=64", "--model.n_layer=2", "--model.n_head=2", "--model.seq_len=64"]
    tiny += ["--train.micro_batch=4", "--eval.every=4", "--eval.batches=2", "--eval.tasks_every=0"]
    train = [
        "train",
        "configs/tiny-cpu.toml",
        f"--data.dir={data}",
        f"--run.dir={run_dir}",
        "--train.max_steps=4",
    ]
    plan = subprocess.Popen(  # beside the training run: each is mostly one core's start-up
        [pretrainer, "plan", "configs/tiny-cpu.toml", f"--data.dir={data}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    trained = subprocess.run(
        [pretrainer, *train, *tiny, "--track.backends=none"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    planned = plan.communicate(timeout=300)
    assert plan.returncode == 0 and "training FLOPs" in planned[0], planned
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints" / "step-0000004").is_dir()
