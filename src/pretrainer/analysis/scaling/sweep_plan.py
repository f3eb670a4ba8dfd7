"""A sweep's plan and its record (analysis/scaling/sweep.py runs it): the runs from a ladder, their cost
against the cap, the plan printed, sweep.json and each run's config (a rerun with another plan or another
thread count is refused), which runs finished, and sweep.csv."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from pretrainer.analysis.scaling.ladder import RunSpec, SweepConfig, plan_runs
from pretrainer.config.keys import config_text, diff_keys
from pretrainer.config.load import load_config
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError, read_exit_record
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
    from pretrainer.data.data_dir import open_data_dir

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


def on_cpu(cfg: Config) -> bool:
    """Whether a run trains on the CPU (train.device cpu, or auto without a GPU torch can use), where
    its thread count decides how its sums split."""
    import torch

    return cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
