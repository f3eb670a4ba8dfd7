"""Pre-launch arithmetic from a config alone: parameters, FLOPs, tokens per step, steps for a budget.

Parameters are counted on a model built on the meta device (no memory), so the plan and the
trainer share one source of truth for every number.
"""

from __future__ import annotations

import math

import torch

from pretrainer.config import Config
from pretrainer.errors import UserError
from pretrainer.flops import flops_per_token
from pretrainer.model import Transformer, count_parameters

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: ~20 training tokens per (total) parameter


def make_plan(cfg: Config, tokens: float | None = None, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM,
              gpus: int = 1) -> dict:
    if cfg.model.vocab_size <= 0:
        raise UserError("plan: model.vocab_size is 0 (taken from data at train time); set it, e.g. --model.vocab_size=50257")
    if gpus < 1:
        raise UserError(f"plan: --gpus must be at least 1, got {gpus}")
    with torch.device("meta"):
        counts = count_parameters(Transformer(cfg.model))
    flops = flops_per_token(cfg.model, counts["non_embedding"])
    tokens_per_step = cfg.train.micro_batch * cfg.model.seq_len * cfg.train.grad_accum * gpus
    budget = tokens if tokens is not None else tokens_per_param * counts["total"]
    steps = math.ceil(budget / tokens_per_step)
    return {
        "arch": cfg.model.arch,
        "params_total": counts["total"],
        "params_non_embedding": counts["non_embedding"],
        "flops_per_token": flops["total"],
        "flops_per_token_terms": flops,
        "tokens_per_step": tokens_per_step,
        "tokens_per_step_terms": {"micro_batch": cfg.train.micro_batch, "seq_len": cfg.model.seq_len,
                                  "grad_accum": cfg.train.grad_accum, "world_size": gpus},
        "token_budget": budget,
        "token_budget_source": "--tokens" if tokens is not None else f"{tokens_per_param:g} tokens per parameter",
        "steps_for_budget": steps,
        "tokens_trained": steps * tokens_per_step,
        "training_flops": flops["total"] * steps * tokens_per_step,
        "configured_max_steps": cfg.train.max_steps,
        "configured_tokens": cfg.train.max_steps * tokens_per_step,
    }


def format_plan(plan: dict) -> str:
    f, t = plan["flops_per_token_terms"], plan["tokens_per_step_terms"]
    rows = [
        ("parameters (total)", f"{plan['params_total']:,}"),
        ("parameters (non-embedding)", f"{plan['params_non_embedding']:,}"),
        ("FLOPs per token", f"{plan['flops_per_token']:,} = 6 x {f['n_matmul_params']:,} + {f['attention']:,} attention"),
        ("  N in 6N", "non-embedding parameters + output projection (vocab x d_model, a matmul even when tied)"),
        ("tokens per optimizer step", f"{plan['tokens_per_step']:,} = {t['micro_batch']} micro-batch x {t['seq_len']} seq_len x "
                                      f"{t['grad_accum']} grad_accum x {t['world_size']} GPUs"),
        ("token budget", f"{plan['token_budget']:,.0f} ({plan['token_budget_source']})"),
        ("steps for the budget", f"{plan['steps_for_budget']:,} ({plan['tokens_trained']:,} tokens)"),
        ("training FLOPs", f"{plan['training_flops']:.3e}"),
        ("configured train.max_steps", f"{plan['configured_max_steps']:,} ({plan['configured_tokens']:,} tokens)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
