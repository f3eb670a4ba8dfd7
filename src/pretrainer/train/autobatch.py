"""train.micro_batch = auto: the largest micro-batch that survives a few full training steps on CUDA.

The search builds its own copy of the model (with the run's activation checkpointing) on one
device, under a forked RNG so the run's initialisation is unchanged. It needs no collective, so
an out-of-memory error on one rank cannot deadlock the others; the ranks then agree on the
smallest result. Candidates are the divisors of the per-rank batch (global_batch / world_size),
largest first, so the global batch is kept exactly and grad_accum absorbs the difference.
"""

from __future__ import annotations

import torch

from pretrainer.config import Config
from pretrainer.device import autocast
from pretrainer.errors import UserError
from pretrainer.model import Transformer
from pretrainer.train.optim import build_optimizer

TRIAL_STEPS = 3


def find_micro_batch(cfg: Config, per_rank_batch: int, device: torch.device, amp_dtype: torch.dtype | None,
                     say=print) -> int:
    if device.type != "cuda":
        raise UserError("train.micro_batch = auto searches GPU memory and needs CUDA; on CPU set a number, e.g. --train.micro_batch=8")
    if cfg.parallel.strategy == "fsdp":
        raise UserError("train.micro_batch = auto is not supported with parallel.strategy = fsdp; set train.micro_batch")
    candidates = [b for b in range(per_rank_batch, 0, -1) if per_rank_batch % b == 0]
    found = 0
    with torch.random.fork_rng(devices=[device]):
        model = Transformer(cfg.model).to(device)
        model.checkpoint_blocks = cfg.train.activation_checkpointing
        for micro_batch in candidates:
            optimizer = build_optimizer(model, cfg.optim, device.type)
            try:
                for _ in range(TRIAL_STEPS):
                    ids = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1), device=device)
                    with autocast(device, amp_dtype):
                        _, loss = model(ids[:, :-1], ids[:, 1:])
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                found = micro_batch
            except torch.cuda.OutOfMemoryError:
                say(f"micro-batch {micro_batch}: out of memory")
            finally:
                del optimizer
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            if found:
                break
        del model
        torch.cuda.empty_cache()
    if not found:
        raise UserError(f"train.micro_batch = auto: even a micro-batch of 1 sequence of {cfg.model.seq_len} does not fit; "
                        f"use parallel.strategy = fsdp, a shorter model.seq_len or a smaller model")
    say(f"micro-batch auto: {found} sequences fit ({TRIAL_STEPS} full steps)")
    return found
