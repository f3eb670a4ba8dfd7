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
import csv
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrainer.analysis.scaling.ladder import RunSpec, SweepConfig, plan_runs
from pretrainer.config.load import load_config
from pretrainer.config.schema import Config, config_text, diff_keys
from pretrainer.core.errors import RunStopped, UserError, exit_code_for_signal, read_exit_record
from pretrainer.core.files import atomic_write_bytes, atomic_write_json

COLUMNS = [
    "run",
    "budget_flops",
    "n_layer",
    "d_model",
    "n_head",
    "params_total",
    "params_non_embedding",
    "tokens",
    "steps",
    "tokens_per_step",
    "lr",
    "flops",
    "val_loss",
    "val_bpb",
    "wall_s",
    "usd",
]
TIMING_COLUMNS = ("wall_s", "usd")  # differ between an interrupted and an uninterrupted sweep


def prepare_plan(sweep: SweepConfig, base: Config) -> tuple[Path, list[RunSpec]]:
    """Resolve the base against its data (the vocabulary) and plan every run. Without the data yet,
    model.vocab_size must be set (a dry run plans before the data is prepared)."""
    from pretrainer.data.loader import open_data_dir

    if not base.data.dir and not base.model.vocab_size:
        raise UserError(
            "sweep: data.dir is not set; pass --data.dir=DIR (a directory written by `pretrainer prepare`)"
        )
    if not base.model.vocab_size or Path(base.data.dir).is_dir():
        base.model.vocab_size = base.model.vocab_size or open_data_dir(base.data.dir).vocab_size
    sweep_dir = Path(os.path.abspath(os.path.expanduser(sweep.dir)))
    return sweep_dir, plan_runs(sweep, base, sweep_dir)


def cost_rows(sweep: SweepConfig, base: Config, runs: list[RunSpec]) -> tuple[list[dict], float | None]:
    """Each run's time and $ as `plan` estimates them (the base's [budget] price and MFU, sweep.gpu or
    budget.peak_tflops) -> (rows, the whole sweep's $ or None without a price and a peak)."""
    from pretrainer.core.hardware import lookup_gpu, training_seconds

    known = lookup_gpu(sweep.gpu) if sweep.gpu else None
    if sweep.gpu and known is None and not base.budget.peak_tflops:
        raise UserError(
            f"sweep.gpu = '{sweep.gpu}' is not a known GPU; set budget.peak_tflops in the base config instead"
        )
    peak = base.budget.peak_tflops or (known.peak_bf16_tflops if known else None)
    price = base.budget.usd_per_gpu_hour or None
    rows, total = [], 0.0
    for run in runs:
        seconds = training_seconds(run.flops, 1, peak, base.budget.mfu) if peak else None
        usd = seconds / 3600 * price if seconds is not None and price else None
        total += usd or 0.0
        rows.append({"seconds": seconds, "usd": usd})
    return rows, (total if peak and price else None)


def format_plan(
    sweep: SweepConfig, base: Config, runs: list[RunSpec], costs: list[dict], total_usd: float | None
) -> str:
    head = (
        f"sweep: {len(runs)} runs, mode {sweep.mode}, lr rule {sweep.lr_rule}, batch rule "
        f"{sweep.batch_rule}; "
        f"{sweep.parallel_runs} at a time"
        + (f", {sweep.cpu_threads} CPU thread{'s' * (sweep.cpu_threads > 1)} each" if on_cpu(base) else "")
    )
    lines = [
        head,
        f"{'run':<22} {'layers':>6} {'width':>6} {'heads':>5} {'params':>12} {'non-emb':>12} {'tokens':>12} "
        f"{'steps':>7} {'lr':>9} {'FLOPs':>10} {'time':>9} {'$':>9}",
    ]
    for run, cost in zip(runs, costs):
        m = run.cfg.model
        hours = f"{cost['seconds'] / 3600:.2f}h" if cost["seconds"] is not None else "-"
        usd = f"{cost['usd']:.2f}" if cost["usd"] is not None else "-"
        lines.append(
            f"{run.name:<22} {m.n_layer:>6} {m.d_model:>6} {m.n_head:>5} {run.params_total:>12,} "
            f"{run.params_non_embedding:>12,} {run.tokens:>12,} {run.cfg.train.max_steps:>7,} "
            f"{run.cfg.optim.lr:>9.2e} "
            f"{run.flops:>10.3e} {hours:>9} {usd:>9}"
        )
    total_flops = sum(r.flops for r in runs)
    if total_usd is not None:
        over = base.budget.cap_usd and total_usd > base.budget.cap_usd
        lines.append(
            f"total: {total_flops:.3e} FLOPs, ${total_usd:,.2f} at "
            f"${base.budget.usd_per_gpu_hour:g}/GPU-hour and "
            f"MFU {base.budget.mfu:g}"
            + (f"; cap ${base.budget.cap_usd:,.2f}" if base.budget.cap_usd else "")
            + (" (OVER the cap: the sweep refuses to start)" if over else "")
        )
    else:
        lines.append(
            f"total: {total_flops:.3e} FLOPs (time and $: set sweep.gpu or budget.peak_tflops, and "
            f"budget.usd_per_gpu_hour)"
        )
    return "\n".join(lines)


def check_plan_files(sweep_dir: Path, runs: list[RunSpec]) -> None:
    """A rerun must plan the same runs: a run whose saved config differs is refused, naming the keys."""
    for run in runs:
        path = sweep_dir / "configs" / f"{run.name}.toml"
        if not path.is_file():
            continue
        # budget.* may change between launches (a raised cap continues a budget-stopped sweep)
        changed = [
            k for k in diff_keys(load_config(path, validated=False), run.cfg) if not k.startswith("budget.")
        ]
        if changed:
            raise UserError(
                f"{path}: this sweep dir planned run {run.name} differently ({', '.join(changed)}); "
                f"rerun with the same settings to continue it, or use a new sweep.dir"
            )


def trained_threads(run: RunSpec) -> int | None:
    """The CPU thread count the run's newest checkpoint recorded (state.json hardware); None before its
    first checkpoint, or when it trained on a GPU."""
    states = sorted((Path(run.cfg.run.dir) / "checkpoints").glob("step-*/state.json"))
    try:
        hardware = json.loads(states[-1].read_text())["hardware"] if states else {}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged checkpoint: the resume itself says what it makes of it
    return hardware.get("cpu_threads") if hardware.get("device_type") == "cpu" else None


def check_trained_threads(sweep: SweepConfig, base: Config, runs: list[RunSpec]) -> None:
    """A CPU sweep goes on with the thread count its runs trained with: another would continue the
    interrupted one, and train the rest, with sums split differently (a CSV of mixed numbers).
    Refused, naming the count that continues it (a sweep from before sweep.cpu_threads included)."""
    if not on_cpu(base):
        return
    for run in runs:
        threads = trained_threads(run)
        if threads is not None and threads != sweep.cpu_threads:
            raise UserError(
                f"{run.cfg.run.dir}: run {run.name} trained with {threads} CPU thread(s) (its checkpoint's "
                f"state.json), not sweep.cpu_threads = {sweep.cpu_threads}; rerun with "
                f"--sweep.cpu_threads={threads} to continue the sweep with the same numbers, or use a new "
                f"sweep.dir"
            )


def write_plan_files(sweep: SweepConfig, sweep_dir: Path, runs: list[RunSpec]) -> None:
    (sweep_dir / "configs").mkdir(parents=True, exist_ok=True)
    for run in runs:
        atomic_write_bytes(sweep_dir / "configs" / f"{run.name}.toml", config_text(run.cfg).encode())
    atomic_write_json(
        sweep_dir / "sweep.json",
        {
            "sweep": {f: getattr(sweep, f) for f in sweep.__dataclass_fields__},
            "runs": [
                {
                    "name": r.name,
                    "config": f"configs/{r.name}.toml",
                    "n_layer": r.cfg.model.n_layer,
                    "d_model": r.cfg.model.d_model,
                    "n_head": r.cfg.model.n_head,
                    "params_total": r.params_total,
                    "params_non_embedding": r.params_non_embedding,
                    "tokens": r.tokens,
                    "flops": r.flops,
                    "budget_flops": r.budget_flops,
                    "lr": r.cfg.optim.lr,
                    "max_steps": r.cfg.train.max_steps,
                }
                for r in runs
            ],
        },
    )


def finished(run: RunSpec) -> bool:
    record = read_exit_record(Path(run.cfg.run.dir) / "exit.json")
    return bool(record) and record["reason"] == "finished" and record["step"] == run.cfg.train.max_steps


def result_row(run: RunSpec, usd_per_gpu_hour: float) -> dict:
    """The CSV row of a finished run, read from its metrics.jsonl: the final validation, the wall time."""
    final_val, elapsed = None, 0.0
    with open(Path(run.cfg.run.dir) / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            elapsed = max(elapsed, record.get("elapsed_s", 0.0))
            if "val_loss" in record and record["step"] == run.cfg.train.max_steps:
                final_val = record
    if final_val is None:
        raise UserError(
            f"{run.cfg.run.dir}/metrics.jsonl: no validation at the final step {run.cfg.train.max_steps}"
        )
    m = run.cfg.model
    return {
        "run": run.name,
        "budget_flops": run.budget_flops,
        "n_layer": m.n_layer,
        "d_model": m.d_model,
        "n_head": m.n_head,
        "params_total": run.params_total,
        "params_non_embedding": run.params_non_embedding,
        "tokens": run.tokens,
        "steps": run.cfg.train.max_steps,
        "tokens_per_step": run.tokens // run.cfg.train.max_steps,
        "lr": run.cfg.optim.lr,
        "flops": run.flops,
        "val_loss": final_val["val_loss"],
        "val_bpb": final_val.get("val_bpb", ""),
        "wall_s": round(elapsed, 3),
        "usd": round(elapsed / 3600 * usd_per_gpu_hour, 6) if usd_per_gpu_hour else "",
    }


def write_csv(sweep_dir: Path, runs: list[RunSpec], usd_per_gpu_hour: float) -> list[dict]:
    """sweep.csv: a row per finished run, in plan order (atomic: a reader never sees half a file)."""
    rows = [result_row(run, usd_per_gpu_hour) for run in runs if finished(run)]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(sweep_dir / "sweep.csv", text.getvalue().encode())
    return rows


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
            with torch_threads(sweep.cpu_threads if on_cpu(run.cfg) else None):
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


def on_cpu(cfg: Config) -> bool:
    """Whether a run trains on the CPU (train.device cpu, or auto without a GPU torch can use), where
    its thread count decides how its sums split."""
    import torch

    return cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())


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
    if received and not stop_code:
        stop_code = exit_code_for_signal(received[0])
    if stop_code:
        say(f"sweep: stopped (exit {stop_code}); the same command continues the sweep")
    return stop_code
