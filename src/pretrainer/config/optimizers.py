"""Every optimizer optim.name can be, in one table: what the config and the plan know of it before one is
built (its auto recipe, the bits of its moments, whether FSDP2 shards its state here) and the module that
builds it. optim/registry.py imports that module when the optimizer is built or measured.

A new optimizer is its module in optim/ plus one entry here. The module defines
    build(groups, model, cfg, *, entry, compile_step) -> torch.optim.Optimizer   (it honours found_inf)
    update_norm(optimizer, skipped) -> tensor   ||delta theta|| of the step just taken, by its own maths
    implementation(optimizer) -> str            for the run's report
    flops_per_step(model) -> int                only where `extra_flops`: matrix FLOPs beyond the model's
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    module: str  # the optim/ module that builds it (imported only then: torchao is an optional extra)
    # the auto recipe (measured on CPU against nanoGPT: docs/benchmarks.md, "The default recipe against
    # nanoGPT"; docs/training.md): optim.lr = auto is lr_at_width_128 x (128 / d_model) to 2 significant
    # figures, optim.warmup_steps = auto this fraction of train.max_steps
    lr_at_width_128: float
    warmup_fraction: float
    # optim.embedding_lr_scale = auto (docs/benchmarks.md, "Quality per token against nanochat")
    embedding_lr_scale: float = 1.0
    moment_bits: int = 32  # bits per stored moment value (Muon: its AdamW half's)
    fsdp: bool = True  # False: parallel.strategy = ddp only (quantised moments are not re-sharded here)
    hidden_momentum_only: bool = False  # Muon: its hidden matrices keep one momentum buffer, no moments
    extra_flops: bool = False  # its module's flops_per_step(model) adds to the model's FLOPs


# AdamW at Muon's lr ends above nanoGPT's loss with 5% warm-up: half the lr (0.47 of nanoGPT's tokens at
# 128 x 4 over 200 steps against 0.70 at 5e-3) and twice the warm-up; Muon is as good at 5% as at 10%
OPTIMIZERS = {
    entry.name: entry
    for entry in (
        OptimizerEntry("adamw", "pretrainer.optim.adamw", 2.5e-3, 0.10),
        OptimizerEntry("adamw8bit", "pretrainer.optim.lowbit", 2.5e-3, 0.10, moment_bits=8, fsdp=False),
        OptimizerEntry("adamw4bit", "pretrainer.optim.lowbit", 2.5e-3, 0.10, moment_bits=4, fsdp=False),
        OptimizerEntry(
            "muon",
            "pretrainer.optim.muon",
            5e-3,
            0.05,
            embedding_lr_scale=10.0,
            hidden_momentum_only=True,
            extra_flops=True,
        ),
    )
}
