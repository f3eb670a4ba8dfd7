"""Runs that survive real clusters, under `pretrainer train --nproc 2` (torchrun, 2 gloo ranks on CPU):
signals to every process, the exit code as a contract, damaged checkpoints, kill -9 anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import losses, tiny_overrides
from support.cluster_helpers import exit_record

from pretrainer.artifacts.checkpoint import list_checkpoints

# --- damaged checkpoints: fall back to the newest intact one, continue identically ---


def damage(checkpoint: Path, kind: str) -> None:
    weights, optimizer = checkpoint / "model.safetensors", checkpoint / "optimizer.pt"
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "bit flip in weights":
        data = bytearray(weights.read_bytes())
        data[len(data) * 3 // 4] ^= 0x10
        weights.write_bytes(bytes(data))
    elif kind == "truncated optimizer":
        optimizer.write_bytes(optimizer.read_bytes()[:100])
    elif kind == "missing state":
        (checkpoint / "state.json").unlink()
    elif kind == "garbage marker":
        (checkpoint / "COMPLETE").write_text("{not json")


def short_run(data: Path, run: Path, **extra):
    from helpers import tiny_config

    return tiny_config(data, run, **{"train.max_steps": 30, "ckpt.every": 10, "eval.every": 0, **extra})


@pytest.fixture(scope="module")
def straight_30(stdlib_data, tmp_path_factory) -> Path:
    from pretrainer.train.loop import train

    run = tmp_path_factory.mktemp("straight30") / "run"
    train(short_run(stdlib_data, run))
    return run


@pytest.mark.parametrize(
    "kind",
    ["truncated weights", "bit flip in weights", "truncated optimizer", "missing state", "garbage marker"],
)
def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(
    kind, straight_30, stdlib_data, tmp_path, capsys
):
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(short_run(stdlib_data, run, **{"train.stop_at_step": 20}))
    damage(run / "checkpoints" / "step-0000020", kind)
    capsys.readouterr()
    train(short_run(stdlib_data, run))
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "damaged checkpoint" in line]
    assert len(warnings) == 1 and "step-0000020" in warnings[0], out[-2000:]
    assert "resuming from" in out and "step-0000010 at step 10" in out
    assert losses(run) == losses(straight_30)  # steps 11-30 recomputed from step 10, identically
    final = lambda r: (r / "checkpoints" / "step-0000030" / "model.safetensors").read_bytes()  # noqa: E731
    assert final(run) == final(straight_30)


def test_no_intact_checkpoint_is_one_line_and_exit_2(stdlib_data, tmp_path, run_cli):
    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(short_run(stdlib_data, run, **{"train.stop_at_step": 20}))
    for checkpoint in list_checkpoints(run):
        damage(checkpoint, "truncated weights")
    code, out, err = run_cli(
        "train", *tiny_overrides(stdlib_data, run, **{"train.max_steps": 30, "ckpt.every": 10})
    )
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "none of the 2 checkpoints is intact" in errors[0]
    assert exit_record(run)["reason"] == "error" and exit_record(run)["exit_code"] == 2
