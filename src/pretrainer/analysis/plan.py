"""Pre-launch arithmetic from a config alone: parameters, tokens, FLOPs, steps, time at an MFU,
$ cost, energy, and memory per GPU.

Parameters are counted on a model built on the meta device (no memory), so the plan and the
trainer share one source of truth for every number.

Memory per GPU: train/memory.py (the same numbers the trainer checks before it allocates).
"""

from __future__ import annotations

import math

from pretrainer.analysis.calibration import events, predicted_seconds
from pretrainer.analysis.costs import checkpoint_plan, cost_lines, with_interruptions
from pretrainer.config.keys import HORIZON_KEYS
from pretrainer.config.preflight import config_warnings
from pretrainer.config.resolve import (
    DataInfo,
    horizon_keys_set,
    horizon_units,
    resolve,
    tokens_per_step,
    train_sequences,
)
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError
from pretrainer.core.hardware import GPU, GPUS, lookup_gpu, training_seconds
from pretrainer.model.flops import flops_per_token, flops_per_token_6n
from pretrainer.model.transformer import total_parameters
from pretrainer.train.memory import planned_memory

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: ~20 training tokens per (total) parameter


def make_plan(
    cfg: Config,
    *,
    tokens: float | None = None,
    tokens_per_param: float | None = None,
    gpus: int = 1,
    gpu: str | None = None,
    peak_tflops: float | None = None,
    gpu_memory_gb: float | None = None,
    gpu_watts: float | None = None,
    mfu: float | None = None,
    usd_per_gpu_hour: float | None = None,
    flops_convention: str = "full",
    data: DataInfo | None = None,
    timings: dict | None = None,
) -> dict:
    """The plan of what cfg will do: train.max_steps steps, unless a token budget is given (`tokens`,
    or `tokens_per_param` x parameters). Price, MFU and peak default to cfg.budget's; `data` (a
    prepared data dir) supplies the vocabulary when model.vocab_size is 0. `timings` (calibration.run_timings
    of a run on this hardware): the wall time is predicted from them, measured, not from an assumed MFU."""
    b = cfg.budget
    mfu = mfu if mfu is not None else b.mfu
    usd_per_gpu_hour = usd_per_gpu_hour if usd_per_gpu_hour is not None else (b.usd_per_gpu_hour or None)
    peak_tflops = peak_tflops or b.peak_tflops or None
    gpu = gpu or b.gpu or None
    if gpus < 1:
        raise UserError(f"plan: --gpus must be at least 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise UserError(f"plan: --mfu must be in (0, 1], got {mfu}")
    if flops_convention not in ("full", "6n"):
        raise UserError(f"plan: --flops must be full or 6n, got {flops_convention}")
    known: GPU | None = lookup_gpu(gpu) if gpu else None
    if gpu and known is None and peak_tflops is None:
        raise UserError(
            f"plan: unknown GPU '{gpu}'; pass --peak-tflops (and --gpu-memory-gb, --gpu-watts) or one of: "
            f"{', '.join(GPUS)}"
        )
    peak = peak_tflops or (known.peak_bf16_tflops if known else None)
    memory_gb = gpu_memory_gb or (known.memory_gb if known else None)
    watts = gpu_watts or (known.board_power_w if known else None)

    given = (horizon_keys_set(cfg.train) or [HORIZON_KEYS[0]])[0]
    given_value = getattr(cfg.train, given.split(".")[1])
    # the same derivations as train: vocab, d_ff, grad_accum, the horizon's steps
    # (--tokens or --tokens-per-param replace the config's horizon)
    cfg = resolve(
        cfg,
        world_size=gpus,
        data=data,
        count_parameters=total_parameters,
        horizon=tokens is None and tokens_per_param is None,
    )
    counts, memory = planned_memory(cfg, gpus, memory_gb)  # the model on the meta device
    step_tokens = tokens_per_step(cfg, gpus)
    flops = flops_per_token(cfg.model, counts["non_embedding"])
    if counts["optimizer_flops_per_step"]:  # Muon's orthogonalisations, spread over the step's tokens
        flops["optimizer"] = counts["optimizer_flops_per_step"] / step_tokens
        flops["total"] += flops["optimizer"]
    per_token = flops["total"] if flops_convention == "full" else flops_per_token_6n(counts["non_embedding"])
    chinchilla_tokens = CHINCHILLA_TOKENS_PER_PARAM * counts["total"]
    if tokens is not None:
        budget, source = tokens, "--tokens"
    elif tokens_per_param is not None:
        budget, source = tokens_per_param * counts["total"], f"{tokens_per_param:g} tokens per parameter"
    else:
        budget, source = cfg.train.max_steps * step_tokens, given
    steps = math.ceil(budget / step_tokens)
    epoch_tokens = train_sequences(data, cfg.model.seq_len) * cfg.model.seq_len if data is not None else 0
    training_flops = per_token * steps * step_tokens
    plan = {
        "arch": cfg.model.arch,
        "vocab_size": cfg.model.vocab_size,
        "params_total": counts["total"],
        "params_non_embedding": counts["non_embedding"],
        "flops_convention": flops_convention,
        "flops_per_token": per_token,
        "flops_per_token_full": flops["total"],
        "flops_per_token_6n": flops_per_token_6n(counts["non_embedding"]),
        "flops_per_token_terms": flops,
        "tokens_per_step": step_tokens,
        "tokens_per_step_terms": {
            "micro_batch": cfg.train.micro_batch,
            "seq_len": cfg.model.seq_len,
            "grad_accum": cfg.train.grad_accum,
            "world_size": gpus,
        },
        "token_budget": budget,
        "token_budget_source": source,
        "steps": steps,
        "tokens_trained": steps * step_tokens,
        "training_flops": training_flops,
        "configured_max_steps": cfg.train.max_steps,
        "configured_tokens": cfg.train.max_steps * step_tokens,
        "horizon": {
            "key": given,
            "value": given_value,
            **horizon_units(steps, step_tokens, counts["total"], epoch_tokens),
        },
        "chinchilla_tokens": chinchilla_tokens,
        "chinchilla_steps": math.ceil(chinchilla_tokens / step_tokens),
        "gpu": {
            "key": gpu,
            "name": known.name if known else gpu,
            "count": gpus,
            "peak_bf16_tflops": peak,
            "memory_gb": memory_gb,
            "board_power_w": watts,
        },
        "strategy": cfg.parallel.strategy,
        "device": cfg.train.device,  # "cpu": no CUDA context in its memory line
        "optimizer": cfg.optim.name,
        "lr_schedule": {
            "lr": cfg.optim.lr,
            "warmup_steps": cfg.optim.warmup_steps,
            "schedule": cfg.optim.schedule,
            "min_lr_ratio": cfg.optim.min_lr_ratio,
        },
        "memory_per_gpu_bytes": memory,
        "warnings": config_warnings(cfg),
    }
    step_s = None  # seconds per step: measured, or at the assumed MFU
    if timings is not None:
        step_s = timings["step_s"]
    elif peak:
        step_s = training_seconds(training_flops, gpus, peak, mfu) / steps
    if step_s is not None:  # ckpt.every (auto: from the write time) counts in the wall time
        checkpoints = checkpoint_plan(cfg.ckpt, steps, step_s, timings, counts["checkpoint_bytes"])
    if timings is not None:  # measured: the run's parts, this plan's counts
        seconds = predicted_seconds(timings, cfg, steps, checkpoints["every"])
        measured_mfu = per_token * timings["tokens_per_s"] / (peak * 1e12 * gpus) if peak else None
        plan.update(
            {
                "time_source": "measured",
                "measured": timings,
                "mfu": measured_mfu,
                "tokens_per_s": timings["tokens_per_s"],
                "wall_hours": seconds / 3600,
                "evaluations": events(cfg.eval.every, steps),
                "checkpoints": events(checkpoints["every"], steps),
            }
        )
    elif peak:  # an assumed MFU is a whole run's: checkpoints and evaluations are inside it
        seconds = step_s * steps
        plan.update(
            {
                "time_source": f"assumed MFU {mfu:g}",
                "mfu": mfu,
                "tokens_per_s": step_tokens / step_s,
                "wall_hours": seconds / 3600,
            }
        )
    if "wall_hours" in plan:
        plan["checkpointing"] = with_interruptions(checkpoints, seconds, step_s)
        if cfg.train.max_hours:  # the step the wall-clock limit stops the run at, at the planned speed
            plan["horizon"]["max_hours"] = cfg.train.max_hours
            plan["horizon"]["max_hours_steps"] = min(
                steps, int(cfg.train.max_hours * 3600 / (seconds / steps))
            )
        if usd_per_gpu_hour is not None:
            plan.update(
                {"usd_per_gpu_hour": usd_per_gpu_hour, "cost_usd": seconds / 3600 * gpus * usd_per_gpu_hour}
            )
            c = plan["checkpointing"]
            restart_s = c["startup_s"] + c["every"] * step_s  # a start-up and one interval trained again
            plan["bill"] = cost_lines(
                b,
                gpus=gpus,
                usd_per_gpu_hour=usd_per_gpu_hour,
                wall_s=seconds,
                restart_s=restart_s,
                interruptions_lost_s=c["lost_s"],
            )
            if b.cap_usd and plan["cost_usd"] > b.cap_usd:
                plan["warnings"].append(
                    f"the planned cost ${plan['cost_usd']:,.2f} exceeds budget.cap_usd = ${b.cap_usd:,.2f}: "
                    f"the trainer refuses to launch it unless budget.allow_over_cap"
                )
        if watts:
            plan["energy_kwh"] = seconds / 3600 * gpus * watts / 1000
    plan["provenance"] = provenance(plan)
    return plan


def provenance(plan: dict) -> dict:
    """Each figure of the plan: computed (exact, from the config), measured (a probe's or a run's),
    assumed (an MFU, a disk speed, a start-up) or declared (a price, a rate the config gives)."""
    time = "measured" if plan.get("time_source") == "measured" else "assumed"
    figures = {
        key: "computed"
        for key in (
            "params_total",
            "params_non_embedding",
            "flops_per_token",
            "tokens_per_step",
            "steps",
            "training_flops",
            "chinchilla_tokens",
            "memory_per_gpu_bytes",
        )
    }
    figures.update(
        {
            key: time
            for key in ("wall_hours", "tokens_per_s", "mfu", "cost_usd", "energy_kwh", "bill")
            if key in plan
        }
    )
    if "measured" in plan and "peak_memory_bytes" in plan["measured"]:
        figures["measured.peak_memory_bytes"] = "measured"
    if "checkpointing" in plan:
        c = plan["checkpointing"]
        figures["checkpointing.write_s"] = c["write_source"].split(":")[0]
        figures["checkpointing.startup_s"] = c["startup_source"]
        figures["checkpointing.every"] = "computed" if c["every_source"].startswith("auto") else "declared"
        figures["checkpointing.interruptions_per_hour"] = "declared"
    if "usd_per_gpu_hour" in plan:
        figures["usd_per_gpu_hour"] = "declared"
    return figures
