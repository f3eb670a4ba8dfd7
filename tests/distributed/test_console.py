"""The console is optional: a trainer whose stdout and stderr go away (`pretrainer train | head -3`,
a closed pipe to tee, a terminal multiplexer that died) trains on to its end and its final
checkpoint, and RUN_DIR/train.log holds everything the console would have shown."""

from __future__ import annotations

import json
import multiprocessing
import os

from helpers import _child, _cli, losses, tiny_overrides

from pretrainer.artifacts.checkpoint import latest_checkpoint


def test_a_closed_console_pipe_switches_output_off_and_training_goes_on(stdlib_data, tmp_path):
    import pretrainer.train.loop  # noqa: F401 (imported once here, not in the child)

    run = tmp_path / "run"
    steps = 60
    args = tiny_overrides(
        stdlib_data, run, **{"train.max_steps": steps, "eval.every": 20, "ckpt.every": 1000}
    )
    read_end, write_end = os.pipe()  # the child's stdout and stderr: a reader that leaves early
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(write_end, {}, _cli, (["train", *args],))
    )
    child.start()
    os.close(write_end)
    with os.fdopen(read_end, "r") as console:
        first = [console.readline() for _ in range(3)]  # as `| head -3` does, then it is gone
    child.join(240)
    assert child.exitcode == 0 and all(first), first
    assert json.loads((run / "exit.json").read_text())["reason"] == "finished"
    assert latest_checkpoint(run).name == f"step-{steps:07d}"  # the final checkpoint
    log = (run / "train.log").read_text()
    assert first[0] in log  # the console's lines, from the first
    logged = [line for line in log.splitlines() if line.startswith("step ") and "| loss" in line]
    assert (
        [int(line.split()[1].split("/")[0]) for line in logged]
        == sorted(losses(run))
        == list(range(1, steps + 1))
    )
    assert "finished at step 60" in log and log.rstrip().endswith("exit: finished (exit 0) at step 60:")
