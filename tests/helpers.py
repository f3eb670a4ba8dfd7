"""Plain helpers the tests share: small real documents, a tiny model's config, the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pretrainer.config.load import load_config
from pretrainer.data.data_dir import open_data_dir

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
        "optim.name": "adamw",  # the machinery's tests; Muon's own are in test_muon and the resume tests
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "eval.every": 20,
        "eval.batches": 4,
        "ckpt.every": 10,
        "log.every": 1,
        "track.backends": "none",
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


def losses(run: Path) -> dict[int, float]:
    """A run's logged training losses by step (metrics.jsonl)."""
    from pretrainer.artifacts.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def train_ranks(nproc: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    """`pretrainer train ARGS` as `nproc` gloo ranks (run_in_ranks): what torchrun's workers run with
    OMP_NUM_THREADS=1, minus their start-up. Where the launcher itself is under test (signals, exit
    codes), tests start `pretrainer train --nproc` instead. -> the ranks' output; all must exit 0."""
    result = run_in_ranks(nproc, _cli_train, [str(a) for a in args], timeout=timeout)
    assert result.returncode == 0, f"exit codes {result.args}\n" + result.stdout[-6000:]
    return result


def run_in_ranks(nproc: int, target, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    """`target(*args)` in `nproc` forked processes (run_forked), each with torchrun's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): real ranks of a gloo group, without a fresh
    interpreter's start-up. -> CompletedProcess(args=the ranks' exit codes, returncode=the one
    furthest from 0, stdout=the ranks' output in rank order)."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return run_forked(target, *args, envs=rank_envs(nproc, port), timeout=timeout)


def rank_envs(nproc: int, port: int) -> list[dict]:
    """The torchrun environment of each of `nproc` ranks on this machine, rendezvous on `port`."""
    return [
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for rank in range(nproc)
    ]


def run_forked(
    target, *args, envs: list[dict] | None = None, timeout: int = 240
) -> subprocess.CompletedProcess:
    """`target(*args)` in processes forked from this one (one per entry of `envs`, each with that
    environment added; default one), with one thread each: a real process, without a fresh
    interpreter's start-up (torch and the package are imported already). A process's exit code is
    target's return value (None: 0; SystemExit's code). -> CompletedProcess(args=the exit codes,
    returncode=the one furthest from 0, stdout=their output (stdout and stderr) in order)."""
    import multiprocessing
    import tempfile

    import pretrainer.train.loop  # noqa: F401 (imported once here, not in every child)

    envs = envs or [{}]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in envs]
    context = multiprocessing.get_context("fork")
    children = [
        context.Process(target=_child, args=(log.fileno(), env, target, args)) for log, env in zip(logs, envs)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout)
    for child in children:
        if child.is_alive():
            child.kill()
            child.join()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [child.exitcode for child in children]
    return subprocess.CompletedProcess(codes, max(codes, key=abs), "".join(outputs), "")


def fork_train(*args, log: Path):
    """`pretrainer train ARGS` in a forked child (fork_cli)."""
    return fork_cli("train", *args, log=log)


def fork_cli(*argv, log: Path):
    """`pretrainer ARGV` in a child process forked from this one, with one thread, its output in
    `log`: a real process to signal or kill, without a fresh interpreter's start-up. -> the child
    (multiprocessing.Process: pid, is_alive(), join(), exitcode: the command's exit code)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return fork_cli_to(fd, *argv)
    finally:
        os.close(fd)


def fork_cli_to(fd: int, *argv):
    """fork_cli with the child's stdout and stderr on the open file descriptor `fd` (a log, a pty)."""
    import multiprocessing

    import pretrainer.train.loop  # noqa: F401 (imported once here, not in every child)

    context = multiprocessing.get_context("fork")
    child = context.Process(target=_child, args=(fd, {}, _cli, ([str(a) for a in argv],)))
    child.start()
    return child


def _cli(argv: list[str]) -> int:
    from pretrainer.cli.main import main

    return main(argv)


def _cli_train(args: list[str]) -> int:
    return _cli(["train", *args])


def _child(log_fd: int, env: dict, target, args) -> None:
    """In a forked child: output to `log_fd`, `env` set, one thread, then exit with target(*args)."""
    import traceback

    import torch

    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    code = 1
    try:
        code = target(*args) or 0
    except SystemExit as e:  # a script's exit
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def split_documents(data_dir: Path, split: str) -> list[str]:
    data = open_data_dir(data_dir)
    tokens = np.asarray(data.tokens(split))
    eot = data.tokenizer.eot_id
    assert tokens[-1] == eot, "every document, including the last, ends with the end-of-text token"
    bounds = np.flatnonzero(tokens == eot)
    starts = np.concatenate([[0], bounds[:-1] + 1])
    return [data.tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, bounds)]


def exit_hook(log: Path) -> str:
    """A run.on_exit command that appends one line per call to `log`: reason, exit code, step, run dir."""
    return (
        f'echo "$PRETRAINER_EXIT_REASON $PRETRAINER_EXIT_CODE $PRETRAINER_STEP $PRETRAINER_RUN_DIR" >> {log}'
    )


def exit_hook_calls(log: Path) -> list[tuple[str, int, int | None, str]]:
    """The calls exit_hook(log) recorded: (reason, exit code, step, run dir) each."""
    lines = log.read_text().splitlines() if log.is_file() else []
    return [(r, int(c), int(s) if s else None, d) for r, c, s, d in (line.split(" ", 3) for line in lines)]
