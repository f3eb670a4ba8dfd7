"""`pretrainer sweep`: run a ladder of sizes from one base config, then `pretrainer fit` its CSV.

    pretrainer sweep SWEEP.toml                               # or: CONFIG --sizes 1M,3M,10M --tokens 2e6
    pretrainer fit SWEEP_DIR                                  # -> fit.json, fit.md, plots

The sweep directory holds what a rerun needs:
    sweep.json        the plan (each run's shape, tokens, FLOPs, lr, batch)
    configs/NAME.toml each run's complete config (a rerun with a different plan is refused)
    runs/NAME/        normal run dirs (resume, eval, export and report work on each)
    sweep.csv         one row per finished run, rewritten atomically as runs finish
    logs/NAME.log     --parallel-runs: each run's output

Runs go one after another in this process, or `parallel_runs` at once as `pretrainer train`
processes, each pinned to its own GPU (CUDA_VISIBLE_DEVICES). A stopped sweep (SIGTERM, budget,
crash) is continued by the same command: finished runs (exit.json: finished at max_steps) are
kept, the interrupted one resumes from its checkpoint, the rest start.

A CPU run's sums split by torch's thread count, so every CPU run trains with sweep.cpu_threads
threads wherever it runs: set around train() in this process (the caller's count restored after),
OMP_NUM_THREADS and MKL_NUM_THREADS in a child's environment (torch starts with them); a rerun with
another count than the runs' checkpoints recorded is refused. The numbers then do not depend on
--parallel-runs, on a process's own thread count (a forked child's, a test's) or on a resume.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrainer.analysis.scaling.ladder import RunSpec, SweepConfig
from pretrainer.analysis.scaling.sweep_plan import (
    check_plan_files,
    check_trained_threads,
    cost_rows,
    finished,
    format_plan,
    on_cpu,
    prepare_plan,
    write_csv,
    write_plan_files,
)
from pretrainer.artifacts.metrics import last_step
from pretrainer.config.schema import Config
from pretrainer.core.errors import RunStopped, UserError, exit_code_for_signal
from pretrainer.core.streams import beside_bars, progress
from pretrainer.train.console import SWEEP_ENV


def run_sweep(sweep: SweepConfig, base: Config, say=print) -> int:
    """Plan, check the cap, then run what is not finished -> the exit code (0: every run finished)."""
    sweep_dir, runs = prepare_plan(sweep, base)
    costs, total_usd = cost_rows(sweep, base, runs)
    say(format_plan(sweep, base, runs, costs, total_usd))
    cap = base.budget.cap_usd
    if cap and total_usd is None:
        say(
            "warning: budget.cap_usd is set but the sweep's cost cannot be planned (set sweep.gpu or "
            "budget.peak_tflops): "
            "only each run's own guard checks it"
        )
    if cap and total_usd is not None and total_usd > cap and not base.budget.allow_over_cap:
        raise UserError(
            f"sweep: the planned ${total_usd:,.2f} exceeds budget.cap_usd = ${cap:,.2f}; drop sizes or "
            f"tokens, "
            f"raise the cap, or set --budget.allow_over_cap"
        )
    check_plan_files(sweep_dir, runs)
    check_trained_threads(sweep, base, runs)
    write_plan_files(sweep, sweep_dir, runs)
    price = base.budget.usd_per_gpu_hour
    done = [run for run in runs if finished(run)]
    pending = [run for run in runs if not finished(run)]
    if done:
        say(
            f"sweep: {len(done)} of {len(runs)} runs already finished ({', '.join(r.name for r in done)}): "
            f"kept"
        )
    write_csv(sweep_dir, runs, price)

    def spent() -> float:  # the finished runs' $, for the remaining cap each run is given
        return sum(row["usd"] or 0.0 for row in write_csv(sweep_dir, runs, price))

    if pending and on_cpu(base):
        say_threads(sweep, say)
    if sweep.parallel_runs > 1:
        code = run_parallel(sweep, base, sweep_dir, runs=runs, pending=pending, spent=spent, say=say)
    else:
        code = run_one_by_one(sweep, base, sweep_dir, runs=runs, pending=pending, spent=spent, say=say)
    rows = write_csv(sweep_dir, runs, price)
    if code == 0:
        next_command = f"pretrainer fit {shlex.quote(str(sweep_dir))}"
        say(f"sweep: {len(rows)} runs finished; {sweep_dir}/sweep.csv\nnext:\n  {next_command}")
    return code


def with_remaining_cap(run: RunSpec, base: Config, spent: float, share: int = 1) -> Config:
    """The run's config with budget.cap_usd = its share of what the sweep's cap leaves (each run's guard
    then stops before the whole goes over; `share` runs at once split it)."""
    import copy

    cfg = copy.deepcopy(run.cfg)
    if base.budget.cap_usd:
        cfg.budget.cap_usd = max((base.budget.cap_usd - spent) / share, 1e-9)
    return cfg


def run_one_by_one(
    sweep: SweepConfig,
    base: Config,
    sweep_dir: Path,
    *,
    runs: list[RunSpec],
    pending: list[RunSpec],
    spent,
    say,
) -> int:
    from pretrainer.train.loop import train

    for run in pending:
        say(f"sweep: run {run.name} ({runs.index(run) + 1} of {len(runs)}): {run.cfg.run.dir}")
        try:
            with torch_threads(sweep.cpu_threads if on_cpu(run.cfg) else None), in_sweep(sweep_dir):
                train(with_remaining_cap(run, base, spent()))
        except RunStopped as stop:
            say(f"sweep: stopped in run {run.name} ({stop}); the same command continues the sweep")
            return stop.exit_code
        finally:
            release_device_memory()
        write_csv(sweep_dir, runs, base.budget.usd_per_gpu_hour)
    return 0


def release_device_memory() -> None:
    """Between runs in one process: compiled graphs of the last shape and its cached GPU memory go."""
    import torch

    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """In this process: torch computes with `threads` threads inside (None: unchanged), and the
    caller's count is back after, however the block ends."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_env(threads: int) -> dict[str, str]:
    """A child `pretrainer train`'s environment for `threads` torch threads: torch starts with
    MKL_NUM_THREADS, else OMP_NUM_THREADS, so both are set (a user's own are overridden)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def say_threads(sweep: SweepConfig, say) -> None:
    """One line when the environment asks for another thread count than the sweep's, and a warning when
    the runs at once would have more threads than the machine has CPUs (OpenMP's busy-waiting threads,
    oversubscribed, ran two tiny runs 40x slower)."""
    asked = {name: os.environ[name] for name in thread_env(sweep.cpu_threads) if os.environ.get(name)}
    if any(value != str(sweep.cpu_threads) for value in asked.values()):
        given = " and ".join(f"{name}={value}" for name, value in asked.items())
        say(
            f"sweep: CPU runs train with sweep.cpu_threads = {sweep.cpu_threads} thread(s) each, not {given} "
            f"(the same count in every run and process keeps the numbers the same; "
            f"--sweep.cpu_threads sets it)"
        )
    cpus = os.cpu_count() or 1
    if sweep.parallel_runs * sweep.cpu_threads > cpus:
        say(
            f"warning: {sweep.parallel_runs} runs at once x {sweep.cpu_threads} threads is more than this "
            f"machine's {cpus} CPUs: oversubscribed OpenMP threads wait on each other and run many times "
            f"slower; lower sweep.parallel_runs or sweep.cpu_threads"
        )


def run_parallel(
    sweep: SweepConfig,
    base: Config,
    sweep_dir: Path,
    *,
    runs: list[RunSpec],
    pending: list[RunSpec],
    spent,
    say,
) -> int:
    """`parallel_runs` `pretrainer train` processes at once, each on its own GPU (or the CPU when the base
    says train.device = cpu); SIGTERM/SIGINT are passed to every running one (each checkpoints)."""
    slots = list(range(sweep.parallel_runs))
    if base.train.device != "cpu":
        import torch

        if torch.cuda.device_count() < sweep.parallel_runs:
            raise UserError(
                f"sweep.parallel_runs = {sweep.parallel_runs} needs that many GPUs; "
                f"{torch.cuda.device_count()} "
                f"visible (or set --train.device=cpu)"
            )
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    bar, say = SweepProgress(runs), beside_bars(say)  # the children's own bars go to their logs
    running: dict[int, tuple[RunSpec, subprocess.Popen]] = {}
    queue, stop_code, received = list(pending), 0, []

    def forward(signum, frame):
        received.append(signum)
        queue.clear()  # no new runs; the running ones checkpoint and exit
        for _, child in running.values():
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while queue or running:
            free = [slot for slot in slots if slot not in running]
            while queue and free and not stop_code and not received:
                run, slot = queue.pop(0), free.pop(0)
                cfg = with_remaining_cap(run, base, spent(), share=len(slots))
                log = open(sweep_dir / "logs" / f"{run.name}.log", "a")
                env = {
                    **os.environ,
                    SWEEP_ENV: str(sweep_dir),  # its closing lines point at the sweep, not a next: block
                    **(
                        {"CUDA_VISIBLE_DEVICES": str(slot)}
                        if base.train.device != "cpu"
                        else thread_env(sweep.cpu_threads)
                    ),
                }
                command = [
                    sys.executable,
                    "-m",
                    "pretrainer",
                    "train",
                    str(sweep_dir / "configs" / f"{run.name}.toml"),
                    *([f"--budget.cap_usd={cfg.budget.cap_usd}"] if base.budget.cap_usd else []),
                ]
                running[slot] = (
                    run,
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    ),
                )
                log.close()
                say(
                    f"sweep: run {run.name} started on "
                    f"{'GPU ' + str(slot) if base.train.device != 'cpu' else 'the CPU'} "
                    f"(log: {sweep_dir}/logs/{run.name}.log)"
                )
            time.sleep(0.2)
            bar.update([run.name for run, _ in running.values()])
            for slot, (run, child) in list(running.items()):
                code = child.poll()
                if code is None:
                    continue
                del running[slot]
                say(f"sweep: run {run.name} {'finished' if code == 0 else f'exited {code}'}")
                if code == 0:
                    write_csv(sweep_dir, runs, base.budget.usd_per_gpu_hour)
                elif not stop_code:
                    stop_code = code if code > 0 else exit_code_for_signal(-code)
                    queue.clear()  # the others finish (or stop on the forwarded signal); no new ones start
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        bar.close()
    if received and not stop_code:
        stop_code = exit_code_for_signal(received[0])
    if stop_code:
        say(f"sweep: stopped (exit {stop_code}); the same command continues the sweep")
    return stop_code


class SweepProgress:
    """A parallel sweep's bar on the terminal (none in a file or pipe): the steps its runs have trained,
    all runs together, read from each run's metrics.jsonl at most once a second, and which are running.
    Steps trained before the first reading (kept runs, resumed ones) are its start, not its rate."""

    def __init__(self, runs: list[RunSpec], file=None):
        self.runs, self.file, self.bar, self.read_at = runs, file, None, 0.0

    def update(self, running: list[str]) -> None:
        if time.monotonic() - self.read_at < 1.0:
            return
        self.read_at = time.monotonic()
        done = sum(
            min(last_step(Path(run.cfg.run.dir) / "metrics.jsonl"), run.cfg.train.max_steps)
            for run in self.runs
        )
        if self.bar is None:
            total = sum(run.cfg.train.max_steps for run in self.runs)
            self.bar = progress(total, "sweep", "step", file=self.file, initial=done)
        self.bar.n = done
        self.bar.set_postfix_str(f"running {', '.join(running)}" if running else "", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def in_sweep(sweep_dir: Path):
    """A run trained in this process as one of the sweep's: its closing lines point at the sweep."""
    before = os.environ.get(SWEEP_ENV)
    os.environ[SWEEP_ENV] = str(sweep_dir)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SWEEP_ENV, None)
        else:
            os.environ[SWEEP_ENV] = before
