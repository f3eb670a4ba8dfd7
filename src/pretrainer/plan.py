"""Pre-launch arithmetic from a config alone: parameters, tokens, FLOPs, steps, time at an MFU,
$ cost, energy, and memory per GPU.

Parameters are counted on a model built on the meta device (no memory), so the plan and the
trainer share one source of truth for every number.

Memory per GPU (bytes; P parameters, sharded over the GPUs under FSDP, replicated under DDP):
  weights 4P (fp32 master), gradients 4P, AdamW moments 8P, plus ~1.5 GiB of CUDA context.
  Activations per token in bf16, per layer (d = d_model, k = KV width, f = d_ff):
    18d + 6k + 8f (llama: fp32 residual + norm outputs, q/k/v before and after RoPE, attention
    output with flash/SDPA (no score matrix kept), four SwiGLU tensors) or 18d + 6k + 4f (gpt2),
  plus 10 x vocab for the logits (bf16 logits, their fp32 copy, the softmax kept for backward).
  With activation checkpointing per block only each block's fp32 input (4d) is kept, and one
  block is recomputed at a time.
These are estimates to choose a micro-batch; the trainer logs the measured peak.
"""

from __future__ import annotations

import math

import torch

from pretrainer.config import Config
from pretrainer.resolve import resolve, resolve_d_ff, tokens_per_step
from pretrainer.errors import UserError
from pretrainer.flops import GPU, GPUS, flops_per_token, flops_per_token_6n, lookup_gpu, training_seconds
from pretrainer.model import Transformer, count_parameters

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: ~20 training tokens per (total) parameter
CUDA_OVERHEAD_BYTES = int(1.5 * 2**30)


def activation_bytes_per_token(cfg: Config) -> dict:
    m = cfg.model
    kv = (m.n_kv_head or m.n_head) * (m.d_model // m.n_head)
    per_layer = 18 * m.d_model + 6 * kv + (8 if m.arch == "llama" else 4) * resolve_d_ff(m)
    logits = 10 * m.vocab_size
    return {"full": m.n_layer * per_layer + logits + 4 * m.d_model,
            "checkpointed": m.n_layer * 4 * m.d_model + per_layer + logits + 4 * m.d_model}


def memory_per_gpu(cfg: Config, params: int, gpus: int, strategy: str, gpu_memory_gb: float | None) -> dict:
    shards = gpus if strategy == "fsdp" else 1
    states = {"weights": 4 * params // shards, "gradients": 4 * params // shards, "adamw": 8 * params // shards}
    per_token = activation_bytes_per_token(cfg)
    per_sequence = {k: v * cfg.model.seq_len for k, v in per_token.items()}
    fixed = sum(states.values()) + CUDA_OVERHEAD_BYTES
    out = {**states, "cuda_overhead": CUDA_OVERHEAD_BYTES,
           "activations": per_sequence["full"] * cfg.train.micro_batch,
           "activations_checkpointed": per_sequence["checkpointed"] * cfg.train.micro_batch}
    out["total"] = fixed + out["activations"]
    out["total_checkpointed"] = fixed + out["activations_checkpointed"]
    if gpu_memory_gb:
        free = gpu_memory_gb * 1e9 - fixed
        out["max_micro_batch"] = max(0, int(free // per_sequence["full"]))
        out["max_micro_batch_checkpointed"] = max(0, int(free // per_sequence["checkpointed"]))
    return out


def make_plan(cfg: Config, tokens: float | None = None, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM,
              gpus: int = 1, gpu: str | None = None, peak_tflops: float | None = None, gpu_memory_gb: float | None = None,
              gpu_watts: float | None = None, mfu: float = 0.4, usd_per_gpu_hour: float | None = None,
              flops_convention: str = "full") -> dict:
    if gpus < 1:
        raise UserError(f"plan: --gpus must be at least 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise UserError(f"plan: --mfu must be in (0, 1], got {mfu}")
    if flops_convention not in ("full", "6n"):
        raise UserError(f"plan: --flops must be full or 6n, got {flops_convention}")
    known: GPU | None = lookup_gpu(gpu) if gpu else None
    if gpu and known is None and peak_tflops is None:
        raise UserError(f"plan: unknown GPU '{gpu}'; pass --peak-tflops (and --gpu-memory-gb, --gpu-watts) or one of: "
                        f"{', '.join(GPUS)}")
    peak = peak_tflops or (known.peak_bf16_tflops if known else None)
    memory_gb = gpu_memory_gb or (known.memory_gb if known else None)
    watts = gpu_watts or (known.board_power_w if known else None)

    cfg = resolve(cfg, world_size=gpus)  # the same derivations as train: vocab, d_ff, grad_accum from global_batch
    with torch.device("meta"):
        counts = count_parameters(Transformer(cfg.model))
    flops = flops_per_token(cfg.model, counts["non_embedding"])
    per_token = flops["total"] if flops_convention == "full" else flops_per_token_6n(counts["non_embedding"])
    step_tokens = tokens_per_step(cfg, gpus)
    budget = tokens if tokens is not None else tokens_per_param * counts["total"]
    steps = math.ceil(budget / step_tokens)
    training_flops = per_token * steps * step_tokens
    plan = {
        "arch": cfg.model.arch,
        "params_total": counts["total"],
        "params_non_embedding": counts["non_embedding"],
        "flops_convention": flops_convention,
        "flops_per_token": per_token,
        "flops_per_token_full": flops["total"],
        "flops_per_token_6n": flops_per_token_6n(counts["non_embedding"]),
        "flops_per_token_terms": flops,
        "tokens_per_step": step_tokens,
        "tokens_per_step_terms": {"micro_batch": cfg.train.micro_batch, "seq_len": cfg.model.seq_len,
                                  "grad_accum": cfg.train.grad_accum, "world_size": gpus},
        "token_budget": budget,
        "token_budget_source": "--tokens" if tokens is not None else f"{tokens_per_param:g} tokens per parameter",
        "steps_for_budget": steps,
        "tokens_trained": steps * step_tokens,
        "training_flops": training_flops,
        "configured_max_steps": cfg.train.max_steps,
        "configured_tokens": cfg.train.max_steps * step_tokens,
        "gpu": {"key": gpu, "name": known.name if known else gpu, "count": gpus, "peak_bf16_tflops": peak,
                "memory_gb": memory_gb, "board_power_w": watts},
        "strategy": cfg.parallel.strategy,
        "memory_per_gpu_bytes": memory_per_gpu(cfg, counts["total"], gpus, cfg.parallel.strategy, memory_gb),
    }
    if peak:
        seconds = training_seconds(training_flops, gpus, peak, mfu)
        plan.update({"mfu": mfu, "tokens_per_s": steps * step_tokens / seconds, "wall_hours": seconds / 3600})
        if usd_per_gpu_hour is not None:
            plan.update({"usd_per_gpu_hour": usd_per_gpu_hour, "cost_usd": seconds / 3600 * gpus * usd_per_gpu_hour})
        if watts:
            plan["energy_kwh"] = seconds / 3600 * gpus * watts / 1000
    return plan


def format_plan(plan: dict) -> str:
    f, t, g = plan["flops_per_token_terms"], plan["tokens_per_step_terms"], plan["gpu"]
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    if plan["flops_convention"] == "full":
        flops_row = (f"{plan['flops_per_token']:,} = 6 x {f['n_matmul_params']:,} + {f['attention']:,} attention "
                     f"(N = non-embedding parameters + output projection, a matmul even when tied)")
    else:
        flops_row = (f"{plan['flops_per_token']:,} = 6 x {plan['params_non_embedding']:,} non-embedding parameters (6N "
                     f"convention; the full count incl. output projection and attention is {plan['flops_per_token_full']:,})")
    rows = [
        ("parameters (total)", f"{plan['params_total']:,}"),
        ("parameters (non-embedding)", f"{plan['params_non_embedding']:,}"),
        ("FLOPs per token", flops_row),
        ("tokens per optimizer step", f"{plan['tokens_per_step']:,} = {t['micro_batch']} micro-batch x {t['seq_len']} seq_len x "
                                      f"{t['grad_accum']} grad_accum x {t['world_size']} GPUs"),
        ("training tokens", f"{plan['token_budget']:,.0f} ({plan['token_budget_source']})"),
        ("steps", f"{plan['steps_for_budget']:,} ({plan['tokens_trained']:,} tokens; config has train.max_steps = "
                  f"{plan['configured_max_steps']:,})"),
        ("training FLOPs", f"{plan['training_flops']:.3e}"),
    ]
    if "wall_hours" in plan:
        rows += [("GPU", f"{g['count']} x {g['name']} ({g['peak_bf16_tflops']:g} TFLOP/s bf16 peak)"),
                 ("wall time", f"{plan['wall_hours']:,.2f} h at MFU {plan['mfu']:g} ({plan['tokens_per_s']:,.0f} tokens/s)")]
        if "cost_usd" in plan:
            rows.append(("cost", f"${plan['cost_usd']:,.2f} at ${plan['usd_per_gpu_hour']:g}/GPU-hour"))
        if "energy_kwh" in plan:
            rows.append(("energy", f"{plan['energy_kwh']:,.1f} kWh at {g['board_power_w']:g} W board power per GPU"))
    else:
        rows.append(("wall time, cost", "give --gpu NAME (or --peak-tflops) to estimate"))
    m = plan["memory_per_gpu_bytes"]
    rows += [
        ("memory per GPU", f"weights {gib(m['weights'])}, gradients {gib(m['gradients'])}, AdamW {gib(m['adamw'])} "
                           f"({plan['strategy']}), CUDA context {gib(m['cuda_overhead'])}"),
        ("  activations", f"{gib(m['activations'])} at micro-batch {t['micro_batch']} -> total {gib(m['total'])}"),
        ("  with act. checkpointing", f"{gib(m['activations_checkpointed'])} -> total {gib(m['total_checkpointed'])}"),
    ]
    if "max_micro_batch" in m:
        rows.append(("  largest micro-batch", f"{m['max_micro_batch']} ({m['max_micro_batch_checkpointed']} with activation "
                                              f"checkpointing) in {g['memory_gb']:g} GB"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
