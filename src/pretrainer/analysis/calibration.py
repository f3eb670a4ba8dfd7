"""A plan's time from measurement instead of an assumed MFU: `plan --from-run RUN_DIR` reads what a run
on this hardware took (its metrics.jsonl) and predicts the planned run from the same parts:

    wall = start-up + steps x step time + evaluations x evaluation time + checkpoints x checkpoint time

step time:        tokens per step / the median logged tokens/s after the first interval (tokens/s is
                  measured without evaluations and checkpoints)
evaluation time:  each validation record's elapsed_s minus that of the logged step it follows
checkpoint time:  the trainer's checkpoint_s records (what the training thread spent on each)
start-up:         the first logged step's elapsed_s minus its steps at the step time: loading,
                  building, the step-0 validation and compile, all billed

    timings = run_timings(Path("runs/tiny"))                # the measured parts, from the run's metrics
    seconds = predicted_seconds(timings, cfg, steps)        # the planned run's wall time
"""

from __future__ import annotations

import statistics
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError


def run_timings(run_dir: Path) -> dict:
    """The parts of a run's wall time, measured (see the module docstring), and the run's own total."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no metrics; --from-run takes a run dir that trained (pretrainer train)")
    records = read_metrics(path)
    logged = [r for r in records if "loss" in r and "elapsed_s" in r and "tokens" in r]
    rates = [r["tokens_per_s"] for r in logged[1:] if r.get("tokens_per_s")]
    if len(logged) < 2 or not rates:
        raise UserError(
            f"{path}: fewer than two logged steps; --from-run needs a run of a few logging intervals "
            f"(lower log.every or train longer)"
        )
    tokens_per_step = logged[-1]["tokens"] / logged[-1]["step"]
    step_s = tokens_per_step / statistics.median(rates)
    at_step = {r["step"]: r["elapsed_s"] for r in logged}
    evals = [r["elapsed_s"] - at_step[r["step"]] for r in records if "val_loss" in r and r["step"] in at_step]
    checkpoints = [r["checkpoint_s"] for r in records if "checkpoint_s" in r]
    first = logged[0]
    return {
        "run_dir": str(run_dir),
        "step_s": step_s,
        "tokens_per_s": statistics.median(rates),
        "eval_s": statistics.median(evals) if evals else None,
        "checkpoint_s": statistics.median(checkpoints) if checkpoints else None,
        "startup_s": max(0.0, first["elapsed_s"] - first["step"] * step_s),
        "run_steps": logged[-1]["step"],
        "run_wall_s": max(r["elapsed_s"] for r in records if "elapsed_s" in r),
    }


def events(every: int, steps: int) -> int:
    """How many evaluations or checkpoints a run of `steps` makes at `every` (one always at its end)."""
    return (steps // every if every else 0) + (1 if not every or steps % every else 0)


def predicted_seconds(timings: dict, cfg: Config, steps: int) -> float:
    """The wall time of `steps` steps of cfg from a run's measured parts (a part the run never did,
    e.g. no evaluation, counts 0 and the plan says it was not measured)."""
    evals = events(cfg.eval.every, steps)  # eval.every = 0 still validates at the last step
    return (
        timings["startup_s"]
        + steps * timings["step_s"]
        + evals * (timings["eval_s"] or 0.0)
        + events(cfg.ckpt.every, steps) * (timings["checkpoint_s"] or 0.0)
    )
