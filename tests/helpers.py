"""Plain helpers the tests share: small real documents, a tiny model's config, the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pretrainer.config.load import load_config
from pretrainer.data.loader import open_data_dir

# Distinct documents with varied content, so splits and boundaries can be checked one by one.
DOCS = [f"def function_{i}(x):\n    # document {i}\n    return x * {i} + {i * i}\n" for i in range(200)]


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


def torchrun(nproc: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pretrainer",
        "train",
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def split_documents(data_dir: Path, split: str) -> list[str]:
    data = open_data_dir(data_dir)
    tokens = np.asarray(data.tokens(split))
    eot = data.tokenizer.eot_id
    assert tokens[-1] == eot, "every document, including the last, ends with the end-of-text token"
    bounds = np.flatnonzero(tokens == eot)
    starts = np.concatenate([[0], bounds[:-1] + 1])
    return [data.tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, bounds)]
