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
    seconds = predicted_seconds(timings, cfg, steps, cfg.ckpt.every)   # the planned run's wall time
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


def predicted_seconds(timings: dict, cfg: Config, steps: int, ckpt_every: int) -> float:
    """The wall time of `steps` steps of cfg, checkpointing every `ckpt_every` steps, from a run's
    measured parts (a part the run never did, e.g. no evaluation, counts 0 and the plan says it was
    not measured)."""
    evals = events(cfg.eval.every, steps)  # eval.every = 0 still validates at the last step
    return (
        timings["startup_s"]
        + steps * timings["step_s"]
        + evals * (timings["eval_s"] or 0.0)
        + events(ckpt_every, steps) * (timings["checkpoint_s"] or 0.0)
    )


def measure_probe(config: str | None, overrides: list[str], steps: int, gpus: int = 1) -> dict:
    """plan --measure: `steps` real steps of the config on this machine (its model, data, optimizer,
    precision and compile setting; --nproc `gpus` when more than one), in a process of its own and a
    temporary run dir, with one evaluation and one checkpoint at its last step -> run_timings of it, plus
    peak_memory_bytes per device: CUDA's allocator peak, or the process's peak RSS on a CPU."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pretrainer-measure-") as tmp:
        run = Path(tmp) / "run"
        argv = [sys.executable, "-m", "pretrainer", "train", *([str(config)] if config else []), *overrides]
        argv += [f"--run.dir={run}", f"--train.stop_at_step={steps}", f"--eval.every={steps}"]
        argv += [f"--ckpt.every={steps}", f"--log.every={max(1, steps // 10)}", "--mlflow.enabled=false"]
        argv += ["--eval.tasks_every=0"] + (["--nproc", str(gpus)] if gpus > 1 else [])
        with open(Path(tmp) / "probe.log", "w+") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(process.pid, 0)  # the probe's own peak RSS, not this process's
            process.returncode = os.waitstatus_to_exitcode(status)
            log.seek(0)
            said = log.read().strip().splitlines()
        if process.returncode != 0:
            raise UserError(
                f"plan --measure: the {steps}-step probe exited {process.returncode}: "
                f"{said[-1] if said else '(no output)'}"
            )
        timings = run_timings(run)
        peaks = [r["peak_memory_gib"] for r in read_metrics(run / "metrics.jsonl") if "peak_memory_gib" in r]
    return {
        **timings,
        "run_dir": f"a {steps}-step probe of this config",
        "peak_memory_bytes": int(max(peaks) * 2**30) if peaks else usage.ru_maxrss * 1024,
        "peak_memory_kind": "CUDA allocator peak" if peaks else "process peak RSS (CPU)",
    }
