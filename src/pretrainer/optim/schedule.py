"""The learning-rate schedule (warm-up, then cosine / linear / constant / WSD to min_lr_ratio) and
setting it into an optimizer's groups."""

from __future__ import annotations

import math

import torch

from pretrainer.config.schema import OptimConfig


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr into every group, times the group's "lr_scale" (optim.embedding_lr_scale);
    torchao keeps lr as a tensor (a new float would recompile its step)."""
    for group in optimizer.param_groups:
        group_lr = lr * group["lr_scale"] if "lr_scale" in group else lr
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(group_lr)
        else:
            group["lr"] = group_lr


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for the update that turns `step` completed steps into step + 1.

    Linear warmup to cfg.lr over warmup_steps, then:
      cosine:   cosine decay from lr to lr * min_lr_ratio at max_steps
      wsd:      constant, then linear decay to lr * min_lr_ratio over the last decay_fraction of max_steps
      constant: lr
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, max_steps - round(cfg.decay_fraction * max_steps))
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return cfg.lr + (floor - cfg.lr) * progress
    return cfg.lr
