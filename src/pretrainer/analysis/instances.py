"""`plan --compare`: the same run (model, tokens, global batch) planned on each instance type of the price
table, one row each: whether it fits, the micro-batch it would use, the time, the whole bill and the
cheapest that fits marked.

Time: a measured MFU (a probe or a run on a GPU of the table, `--gpu` naming it) carries to the other
GPUs through their peak-FLOP ratio (a compute-bound step; a memory-bound small model gains less from a
faster GPU than that), otherwise budget.mfu is assumed; each row says which.

    rows = compare_instances(cfg, INSTANCES, sequences_per_step=512, mfu=0.4, mfu_source="assumed",
                             make_plan=make_plan)
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError
from pretrainer.core.hardware import INSTANCES, Instance, lookup_gpu


def load_instances(prices: str | None) -> list[Instance]:
    """The price table, with `prices` (a TOML file of [[instance]] rows: name, gpu, count,
    usd_per_gpu_hour) replacing rows of the same name and adding the others."""
    table = {instance.name: instance for instance in INSTANCES}
    if not prices:
        return list(table.values())
    path = Path(prices)
    try:
        rows = tomllib.loads(path.read_text()).get("instance", [])
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: cannot read the price table ({e}); see docs/planning.md for its form")
    for i, row in enumerate(rows):
        try:
            instance = Instance(
                str(row["name"]),
                str(row["gpu"]),
                int(row["count"]),
                float(row["usd_per_gpu_hour"]),
                str(row.get("source", str(path))),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"{path}: [[instance]] {i + 1} needs name, gpu, count and usd_per_gpu_hour ({e!r} is missing "
                f"or wrong)"
            )
        if lookup_gpu(instance.gpu) is None or instance.count < 1 or instance.usd_per_gpu_hour <= 0:
            raise UserError(
                f"{path}: [[instance]] {instance.name}: gpu must be a hardware-table name (plan --help), "
                f"count >= 1 and usd_per_gpu_hour > 0"
            )
        table[instance.name] = instance
    return list(table.values())


def micro_batch_for(per_rank: int, largest: int) -> int:
    """The largest micro-batch that fits (`largest`) and divides this rank's sequences per step."""
    return max((m for m in range(1, min(per_rank, largest) + 1) if per_rank % m == 0), default=0)


def compare_instances(
    cfg: Config,
    instances: list[Instance],
    *,
    sequences_per_step: int,
    mfu: float,
    mfu_source: str,
    make_plan,
    own_gpu: str | None = None,
    **plan_kwargs,
) -> list[dict]:
    """One row per instance: the run of cfg (its sequences per step kept) planned there."""
    rows = []
    for instance in instances:
        gpu = lookup_gpu(instance.gpu)
        row = {
            "instance": instance.name,
            "gpu": gpu.name,
            "count": instance.count,
            "usd_per_gpu_hour": instance.usd_per_gpu_hour,
            "price_source": instance.source,
        }
        if sequences_per_step % instance.count:
            rows.append(
                {
                    **row,
                    "fits": False,
                    "note": f"{sequences_per_step} sequences per step do not split "
                    f"over {instance.count} GPUs",
                }
            )
            continue
        per_rank = sequences_per_step // instance.count
        trial = copy.deepcopy(cfg)
        trial.train.micro_batch, trial.train.global_batch = 1, sequences_per_step
        probe = make_plan(trial, gpus=instance.count, gpu=instance.gpu, mfu=mfu, **plan_kwargs)
        memory = probe["memory_per_gpu_bytes"]
        checkpointing = cfg.train.activation_checkpointing  # else only when nothing fits without it
        micro = micro_batch_for(
            per_rank, memory["max_micro_batch_checkpointed" if checkpointing else "max_micro_batch"]
        )
        if not micro and not checkpointing:
            micro, checkpointing = micro_batch_for(per_rank, memory["max_micro_batch_checkpointed"]), True
        if not micro:
            rows.append({**row, "fits": False, "note": "does not fit, even at micro-batch 1"})
            continue
        trial.train.micro_batch, trial.train.activation_checkpointing = micro, checkpointing
        plan = make_plan(
            trial,
            gpus=instance.count,
            gpu=instance.gpu,
            mfu=mfu,
            usd_per_gpu_hour=instance.usd_per_gpu_hour,
            **plan_kwargs,
        )
        bill = plan["bill"]
        if cfg.budget.max_usd_per_gpu_hour and gpu is not lookup_gpu(cfg.budget.gpu or own_gpu or ""):
            # a declared price limit is the config's own GPU's (the lab's $1.40 is an A100's): others need
            # only fit the cap
            bill["go"] = not cfg.budget.cap_usd or bill["total_usd"] <= cfg.budget.cap_usd
        rows.append(
            {
                **row,
                "fits": True,
                "micro_batch": micro,
                "grad_accum": per_rank // micro,
                "activation_checkpointing": trial.train.activation_checkpointing,
                "largest_micro_batch": memory["max_micro_batch"],
                "wall_hours": plan["wall_hours"],
                "total_usd": bill["total_usd"],
                "go": bill["go"],
                "mfu": mfu,
                "mfu_source": mfu_source,
                "note": "activation checkpointing" if checkpointing else "",
            }
        )
    fitting = [row for row in rows if row["fits"]]
    if fitting:
        min(fitting, key=lambda row: row["total_usd"])["cheapest"] = True
    return rows


def format_comparison(rows: list[dict]) -> str:
    header = ("instance", "GPUs", "$/GPU-h", "fits", "micro x accum", "largest", "hours", "total $", "")
    table = [header]
    for r in rows:
        if not r["fits"]:
            table.append(
                (
                    r["instance"],
                    f"{r['count']} x {r['gpu']}",
                    f"{r['usd_per_gpu_hour']:g}",
                    "no",
                    "",
                    "",
                    "",
                    "",
                    r["note"],
                )
            )
            continue
        mark = "<- cheapest" if r.get("cheapest") else ""
        mark += ("; " if mark and not r["go"] else "") + (
            "" if r["go"] else "no-go (over the cap or price limit)"
        )
        table.append(
            (
                r["instance"],
                f"{r['count']} x {r['gpu']}",
                f"{r['usd_per_gpu_hour']:g}",
                "yes",
                f"{r['micro_batch']} x {r['grad_accum']}",
                str(r["largest_micro_batch"]),
                f"{r['wall_hours']:,.2f}",
                f"{r['total_usd']:,.2f}",
                "; ".join(part for part in (r["note"], mark) if part),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        lines.append(
            f"time at MFU {fitting[0]['mfu']:.3f} ({fitting[0]['mfu_source']}); total $ = every bill line "
            f"(compute, data preparation, disk, restarts, interruptions); prices: docs/planning.md"
        )
    return "\n".join(lines)
