"""One trainer per run dir: a second `pretrainer train` on the same run dir (a double-submitted job,
a requeue racing a manual restart), started at the same moment or seconds later, on a fresh run or a
resume, exits 2 with one line naming the holder and writes nothing; the run it found goes on exactly
as it would have alone. The trainers are processes forked from the test process (helpers.fork_train)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import exit_hook, exit_hook_calls, fork_train, losses, tiny_overrides

from pretrainer.artifacts.checkpoint import list_checkpoints

STEPS = 120  # long enough (seconds) that a trainer started once the first is training finds it running
SETTINGS = {"train.max_steps": STEPS, "ckpt.every": 40, "eval.every": 0, "log.every": 10}


def trained(run: Path) -> dict:
    """What a run left: its logged losses, its checkpoints' weights and its exit record."""
    weights = {c.name: (c / "model.safetensors").read_bytes() for c in list_checkpoints(run)}
    return {
        "losses": losses(run),
        "weights": weights,
        "exit": json.loads((run / "exit.json").read_text())["reason"],
    }


@pytest.fixture(scope="module")
def lone(stdlib_data, tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("lone") / "run"
    child = fork_train(*tiny_overrides(stdlib_data, run, **SETTINGS), log=run.parent / "log")
    child.join(240)
    assert child.exitcode == 0, (run.parent / "log").read_text()[-2000:]
    return trained(run)


def holder(run: Path) -> int | None:
    """The PID the run's lock file names (read, never locked here: a probe that took the lock for a
    moment could turn a trainer away)."""
    try:
        said = (run / ".lock").read_text().split()
    except FileNotFoundError:
        return None
    return int(said[1]) if len(said) > 1 and said[0] == "pid" else None


def wait_until_training(run: Path, trainers: list, after_step: int, timeout: float = 60) -> None:
    """Until one of `trainers` holds the lock and has logged a step past `after_step`: a fixed sleep
    would let the whole run finish first on a fast machine, and a late trainer find nothing to do."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        logged = losses(run) if (run / "metrics.jsonl").is_file() else {}
        alive = {child.pid for child in trainers if child.is_alive()}
        if holder(run) in alive and max(logged, default=0) > after_step:
            return
        time.sleep(0.01)
    raise AssertionError(f"no trainer took {run} within {timeout} s")


@pytest.mark.parametrize("stage", ["fresh", "resume"])
def test_a_second_trainer_on_a_run_dir_exits_with_one_line_and_the_first_trains_alone(
    stage, lone, stdlib_data, tmp_path
):
    """Three trainers on one run dir: two started together, a third once one is training. One trains."""
    run = tmp_path / "run"
    if stage == "resume":  # an interrupted run to continue: every trainer would resume it
        part = fork_train(
            *tiny_overrides(stdlib_data, run, **SETTINGS, **{"train.stop_at_step": 40}), log=tmp_path / "part"
        )
        part.join(240)
        assert part.exitcode == 0
    # every trainer has the hook; only the one that trains runs it (one that found the run in use must
    # not: a hook may shut the machine down)
    args = tiny_overrides(stdlib_data, run, **SETTINGS, **{"run.on_exit": exit_hook(tmp_path / "hook")})
    together = [fork_train(*args, log=tmp_path / name) for name in ("a", "b")]
    wait_until_training(run, together, after_step=40 if stage == "resume" else 0)
    later = fork_train(*args, log=tmp_path / "c")
    for child in (*together, later):
        child.join(240)
    codes = {name: child.exitcode for name, child in zip("abc", (*together, later))}
    assert sorted(codes.values()) == [0, 2, 2], {
        name: (tmp_path / name).read_text()[-1500:] for name in codes
    }
    for name in (name for name, code in codes.items() if code == 2):
        said = (tmp_path / name).read_text()
        errors = [line for line in said.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "in use by pid " in errors[0] and "Traceback" not in said, said[-1500:]
        # nothing else but, where the winner had already written the run's config (the third trainer; under
        # load also one started "together"), the note that it read it
        others = [line for line in said.strip().splitlines() if line != errors[0]]
        assert all(line.startswith("note: continuing with the saved config ") for line in others), said
    assert exit_hook_calls(tmp_path / "hook") == [("finished", 0, STEPS, str(run))]
    assert trained(run) == lone  # every loss, every checkpoint byte, and the exit record: the lone run's


def test_removing_the_lock_file_mid_run_lets_no_second_trainer_in(lone, stdlib_data, tmp_path):
    """`rm RUN/.lock` while a trainer runs, then a second trainer on the run: the run dir's own lock
    still holds, so the second exits 2 with one line, the first puts the file back and trains on alone."""
    run = tmp_path / "run"
    args = tiny_overrides(stdlib_data, run, **SETTINGS)
    first = fork_train(*args, log=tmp_path / "a")
    wait_until_training(run, [first], after_step=0)
    (run / ".lock").unlink()
    second = fork_train(*args, log=tmp_path / "b")
    second.join(240)
    said = (tmp_path / "b").read_text()
    errors = [line for line in said.splitlines() if line.startswith("error: ")]
    assert second.exitcode == 2 and len(errors) == 1 and "in use by" in errors[0], said[-1500:]
    wait_until_training(run, [first], after_step=max(losses(run)))  # .lock names the first trainer again
    first.join(240)
    assert first.exitcode == 0, (tmp_path / "a").read_text()[-1500:]
    assert trained(run) == lone
