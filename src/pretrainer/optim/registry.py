"""Every optimizer optim.name can be, in one table: how it is built, what its state takes, the FLOPs its
step adds, how the size of its update is measured and how the run's report describes it. Nothing
else branches on an optimizer's name.

    optimizer = build_optimizer(model, cfg.optim, "cuda")     # optimizer.kind: its entry here
    optimizer_kind(cfg.optim.name).flops_per_step(model)      # Muon's orthogonalisations; 0 for AdamW
    update_norm(optimizer, skipped)                           # ||delta theta|| of the step just taken

A new optimizer is its module (build, update norm) plus one entry in OPTIMIZERS, and its auto recipe
in config/schema.py's OPTIMIZER_RECIPES (the config layer sits below this one, and resolves optim.lr
= auto before any optimizer is built; a test keeps the two tables' names equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pretrainer.config.schema import OptimConfig
from pretrainer.core.errors import UserError
from pretrainer.optim.adamw import adamw_update_norm, param_groups


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    moment_bits: int  # bits per stored moment value (Muon: its AdamW half's)
    # (param groups, model, cfg, compile the update) -> the optimizer
    build: Callable[[list, nn.Module, OptimConfig, bool], torch.optim.Optimizer]
    implementation: Callable[[torch.optim.Optimizer], str]  # for the report
    # ||delta theta|| of the step just taken, from the optimizer's state (0 for a skipped update)
    update_norm: Callable[[torch.optim.Optimizer, torch.Tensor | None], torch.Tensor] = adamw_update_norm
    flops_per_step: Callable[[nn.Module], int] = lambda model: 0  # matrix FLOPs beyond the model's
    hidden_momentum_only: bool = False  # Muon: its hidden matrices keep one momentum buffer, no moments


def _fused_adamw(groups, model, cfg: OptimConfig, compile_step: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def _low_bit(bits: int):
    def build(groups, model, cfg: OptimConfig, compile_step: bool) -> torch.optim.Optimizer:
        from pretrainer.optim import lowbit  # torchao: an optional extra

        betas = (cfg.beta1, cfg.beta2)
        return lowbit.build(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, bits=bits, compile_step=compile_step)

    return build


def _low_bit_implementation(optimizer) -> str:
    import importlib.metadata

    version = importlib.metadata.version("torchao")
    compiled = "compiled" if optimizer.compile_step else "eager"
    return f"torchao.optim.{type(optimizer).__name__} (torchao {version}), update {compiled}"


def _muon(groups, model, cfg: OptimConfig, compile_step: bool) -> torch.optim.Optimizer:
    from pretrainer.optim.muon import MuonAdamW, with_muon_group

    groups = with_muon_group(groups, model, cfg.weight_decay)
    return MuonAdamW(groups, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.muon_momentum)


def _muon_flops(model: nn.Module) -> int:
    from pretrainer.optim.muon import optimizer_flops_per_step

    return optimizer_flops_per_step(model)


OPTIMIZERS = {
    "adamw": OptimizerKind(
        "adamw", 32, _fused_adamw, lambda optimizer: f"torch.optim.AdamW, fused (torch {torch.__version__})"
    ),
    "adamw8bit": OptimizerKind("adamw8bit", 8, _low_bit(8), _low_bit_implementation),
    "adamw4bit": OptimizerKind("adamw4bit", 4, _low_bit(4), _low_bit_implementation),
    "muon": OptimizerKind(
        "muon",
        32,
        _muon,
        lambda optimizer: (
            "optim/muon.MuonAdamW: Muon (Newton-Schulz, 5 steps) for the hidden matrices, AdamW for the rest"
        ),
        update_norm=lambda optimizer, skipped: optimizer.update_norm(skipped),  # measured as it stepped
        flops_per_step=_muon_flops,
        hidden_momentum_only=True,
    ),
}


def optimizer_kind(name: str) -> OptimizerKind:
    """OPTIMIZERS[name], or one line naming the choices (a config built in code skips the loader's check)."""
    if name not in OPTIMIZERS:
        choices = ", ".join(OPTIMIZERS)
        raise UserError(f"optim.name = {name!r} is not an optimizer here; choose one of {choices}")
    return OPTIMIZERS[name]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str, compile_step: bool = False
) -> torch.optim.Optimizer:
    """cfg.name's optimizer over the model's parameter groups (weight decay on matrices only). Fused
    AdamW on CUDA and CPU: one kernel per step, and it takes `optimizer.found_inf`, a device tensor that
    skips the whole update (parameters, moments, step count) without a host sync; the loop uses it to
    keep non-finite and flagged steps away from the weights. Every optimizer here honours found_inf.
    The low-bit ones' update is compiled on CUDA or when `compile_step`."""
    if cfg.lr <= 0:  # optim.lr = auto is a number only once config/resolve.py has seen the model
        raise ValueError("optim.lr is auto (0): build the optimizer from a resolved config")
    kind = optimizer_kind(cfg.name)
    groups = param_groups(model, cfg.weight_decay)
    optimizer = kind.build(groups, model, cfg, compile_step or device_type == "cuda")
    optimizer.kind = kind
    return optimizer


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict:
    """What the report records about the optimizer (its state's size is measured at each checkpoint)."""
    return {"name": optimizer.kind.name, "implementation": optimizer.kind.implementation(optimizer)}


def update_norm(optimizer: torch.optim.Optimizer, skipped: torch.Tensor | None = None) -> torch.Tensor:
    """||delta theta|| of the step just taken, as the optimizer's own entry measures it."""
    kind = getattr(optimizer, "kind", OPTIMIZERS["adamw"])  # a torch.optim.AdamW made by hand
    return kind.update_norm(optimizer, skipped)
