"""Plain helpers the tests share: small real documents, a tiny model's config, the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pretrainer.config.load import load_config

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


def train_ranks(nproc: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    """`pretrainer train ARGS` as `nproc` gloo ranks, each a fork of this process with torchrun's
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and one thread, as torchrun's workers
    with OMP_NUM_THREADS=1 would run it, minus the start-up: torch and the package are imported
    already. Where the launcher itself is under test (signals, exit codes), tests start
    `pretrainer train --nproc` instead. -> the ranks' output (rank 0 prints) and their exit code."""
    import multiprocessing
    import socket
    import tempfile

    import pretrainer.train.loop  # noqa: F401 (imported once here, not in every rank)

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_rank, args=(rank, nproc, port, logs[rank].fileno(), [str(a) for a in args]))
        for rank in range(nproc)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [process.exitcode for process in ranks]
    result = subprocess.CompletedProcess(
        ["train", *map(str, args)], max(codes, key=abs), "".join(outputs), ""
    )
    assert codes == [0] * nproc, f"exit codes {codes}\n" + result.stdout[-6000:]
    return result


def _rank(rank: int, world: int, port: int, log_fd: int, args: list[str]) -> None:
    """One forked rank: torchrun's environment, then `pretrainer train ARGS` (never returns)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _train_and_exit(log_fd, args)


def fork_train(*args, log: Path):
    """`pretrainer train ARGS` in a forked child process with one thread, its output in `log`: a
    real process to signal or kill, without a fresh interpreter's start-up. -> the child
    (multiprocessing.Process: pid, is_alive(), join(), exitcode)."""
    import multiprocessing

    import pretrainer.train.loop  # noqa: F401 (imported once here, not in every child)

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    child = multiprocessing.get_context("fork").Process(
        target=_train_and_exit, args=(fd, [str(a) for a in args])
    )
    child.start()
    os.close(fd)
    return child


def _train_and_exit(log_fd: int, args: list[str]) -> None:
    """In a forked child: output to `log_fd`, one thread, `pretrainer train ARGS`, exit with its code."""
    import traceback

    import torch

    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    code = 1
    try:
        from pretrainer.cli.main import main

        code = main(["train", *args])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
