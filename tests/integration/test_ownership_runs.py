"""What `--force`, every export format and a second `prepare` may replace: only
an output pretrainer marked as its own, never a checkpoint's file, a run inside a data dir, another
tool's file, or what a link points at (the rule: src/pretrainer/core/ownership.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_tasks import write_jsonl
from helpers import DOCS
from safetensors.torch import save_file

from pretrainer.artifacts.runs import open_run


@pytest.fixture(scope="module")
def small_run(stdlib_data, tmp_path_factory) -> Path:
    """A finished 10-step run with a checkpoint at step 10."""
    from helpers import tiny_config

    from pretrainer.train.loop import train

    run = tmp_path_factory.mktemp("small") / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 10, "eval.every": 10}))
    return run


def files_of(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def test_export_force_never_overwrites_a_checkpoint_or_another_tool_s_file(small_run, tmp_path, run_cli):
    other_run = shutil.copytree(small_run, tmp_path / "other-run")
    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.zeros(3)}, theirs, metadata={"format": "pt"})
    their_gguf = tmp_path / "llama.gguf"
    their_gguf.write_bytes(b"GGUF" + bytes(100))  # another tool's GGUF: the magic number proves nothing
    before = {tree: files_of(tree) for tree in (small_run, other_run)}
    theirs_before, their_gguf_before = theirs.read_bytes(), their_gguf.read_bytes()
    cases = [
        (
            "safetensors",
            small_run / "checkpoints" / "step-0000010" / "model.safetensors",
            "inside the checkpoint",
        ),
        (
            "safetensors",
            other_run / "checkpoints" / "step-0000010" / "model.safetensors",
            "inside the checkpoint",
        ),
        ("gguf", small_run / "checkpoints" / "step-0000010" / "model.gguf", "inside the checkpoint"),
        ("hf", small_run / "checkpoints" / "step-0000099", "inside the checkpoints of the run"),
        ("safetensors", theirs, "is not a safetensors export pretrainer wrote"),
        ("gguf", their_gguf, "is not a GGUF export pretrainer wrote"),
        ("safetensors", small_run / "metrics.jsonl", "is not a safetensors export"),
    ]
    for fmt, out, why in cases:
        code, stdout, err = run_cli("export", small_run, "--format", fmt, "--out", out, "--force")
        assert code == 2 and err.count("\n") == 1 and why in err, (fmt, out, stdout + err)
    assert {tree: files_of(tree) for tree in (small_run, other_run)} == before
    assert theirs.read_bytes() == theirs_before and their_gguf.read_bytes() == their_gguf_before
    assert open_run(small_run).step == 10  # eval and resume still find the checkpoint intact
    # what pretrainer exported itself: replaced by --force, a GGUF into a new directory too
    for fmt, out in [
        ("safetensors", tmp_path / "m.safetensors"),
        ("gguf", tmp_path / "new" / "dir" / "m.gguf"),
    ]:
        for _ in range(2):
            code, stdout, err = run_cli("export", small_run, "--format", fmt, "--out", out, "--force")
            assert code == 0, stdout + err


def test_prepare_force_never_deletes_a_run_that_lives_in_its_output(
    small_run, tmp_path, run_cli, jsonl_corpus
):
    prepare = ["prepare", "--corpus", jsonl_corpus, "--tokenizer", "bpe:300", "--val-fraction", "0.1"]
    data = tmp_path / "data"
    assert run_cli(*prepare, "--out", data)[0] == 0
    myrun = shutil.copytree(small_run, data / "runs" / "myrun")  # --run.dir=D/runs/myrun
    kept = files_of(myrun)
    code, stdout, err = run_cli(*prepare, "--out", data, "--force")
    assert code == 2 and err.count("\n") == 1 and f"holds the run dir {myrun}" in err, stdout + err
    assert files_of(myrun) == kept
    # a link to a prepared dir is not replaced (nor renamed away): its target stays as it was
    shutil.rmtree(data / "runs")
    link = tmp_path / "link"
    link.symlink_to(data)
    before = files_of(data)
    code, stdout, err = run_cli(*prepare, "--out", link, "--force")
    assert code == 2 and err.count("\n") == 1 and "is a symbolic link" in err, stdout + err
    assert link.is_symlink() and files_of(data) == before


def test_two_prepares_into_one_new_dir_one_wins_the_other_says_so(tmp_path):
    """Two real processes started together, each working ~0.7 s: both find no --out at their start (a
    fork of this process could inherit a tokenizer's thread pool mid-use)."""
    corpus = write_jsonl(
        tmp_path / "docs.jsonl",
        [{"text": f"{doc} ({i}-{j})"} for i in range(40) for j, doc in enumerate(DOCS)],
    )
    out = tmp_path / "data"
    argv = ["prepare", "--corpus", corpus, "--tokenizer", "bpe:300", "--out", out, "--workers", "1"]
    twins = [
        subprocess.Popen(
            [sys.executable, "-m", "pretrainer", *map(str, argv), "--seed", str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in (1, 2)
    ]
    texts = [twin.communicate(timeout=120)[0] for twin in twins]
    codes = [twin.returncode for twin in twins]
    assert sorted(codes) == [0, 2], texts
    loser = texts[codes.index(2)]
    errors = [line for line in loser.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("another process" in errors[0] or "already exists" in errors[0]), loser
    assert "Traceback" not in loser
    assert f"--seed {codes.index(0) + 1}" in (out / "manifest.json").read_text(), "the winner's data stays"
    assert not list(tmp_path.glob(".data.*")), "no temp dir left"
