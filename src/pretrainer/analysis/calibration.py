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

from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics, run_timings
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError


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


# `python -m pretrainer ARGS` that writes its own peak RSS (VmHWM) to a file as it exits. Its own: the rusage
# a parent reads with wait4 also holds the parent's peak, folded in when the child's exec replaced the
# address space it was spawned with (vfork): a probe launched from a big process reports that one's size.
_PEAK_RSS_MAIN = (
    "import atexit, sys\n"
    "from pretrainer.cli.main import main\n"
    "def record(path=sys.argv.pop(1)):\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(path, 'w').write(str(int(line.split()[1]) * 1024))\n"
    "atexit.register(record)\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_measuring_peak_rss(args: list[str], log, scratch: Path) -> tuple[int, int | None]:
    """`pretrainer ARGS` in a process of its own -> (its exit code, its own peak RSS in bytes, None where
    /proc is missing)."""
    import os
    import subprocess
    import sys

    peak_file = scratch / f"peak-rss-{os.getpid()}"
    if not Path("/proc/self/status").is_file():  # no VmHWM (macOS): wait4's rusage, this process's peak in it
        process = subprocess.Popen(
            [sys.executable, "-m", "pretrainer", *args], stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(process.pid, 0)
        return os.waitstatus_to_exitcode(status), usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    code = subprocess.call(
        [sys.executable, "-c", _PEAK_RSS_MAIN, str(peak_file), *args], stdout=log, stderr=subprocess.STDOUT
    )
    peak = int(peak_file.read_text()) if peak_file.is_file() else None
    peak_file.unlink(missing_ok=True)
    return code, peak


def measure_probe(config: str | None, overrides: list[str], steps: int, gpus: int = 1) -> dict:
    """plan --measure: `steps` real steps of the config on this machine (its model, data, optimizer,
    precision and compile setting; --nproc `gpus` when more than one), in a process of its own and a
    temporary run dir, with one evaluation and one checkpoint at its last step -> run_timings of it, plus
    peak_memory_bytes per device: CUDA's allocator peak, or the process's own peak RSS on a CPU."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pretrainer-measure-") as tmp:
        run = Path(tmp) / "run"
        args = ["train", *([str(config)] if config else []), *overrides]
        args += [f"--run.dir={run}", f"--train.stop_at_step={steps}", f"--eval.every={steps}"]
        args += [f"--ckpt.every={steps}", f"--log.every={max(1, steps // 10)}", "--track.backends=none"]
        args += ["--eval.tasks_every=0"] + (["--nproc", str(gpus)] if gpus > 1 else [])
        with open(Path(tmp) / "probe.log", "w+") as log:
            code, rss = run_measuring_peak_rss(args, log, Path(tmp))
            log.seek(0)
            said = log.read().strip().splitlines()
        if code != 0:
            raise UserError(
                f"plan --measure: the {steps}-step probe exited {code}: {said[-1] if said else '(no output)'}"
            )
        timings = run_timings(run)
        peaks = [r["peak_memory_gib"] for r in read_metrics(run / "metrics.jsonl") if "peak_memory_gib" in r]
    return {
        **timings,
        "run_dir": f"a {steps}-step probe of this config",
        "peak_memory_bytes": int(max(peaks) * 2**30) if peaks else rss,
        "peak_memory_kind": "CUDA allocator peak" if peaks else "process peak RSS (CPU)",
    }
