"""The optimizers config/optimizers.py lists, built and measured through their own modules. Nothing else
branches on an optimizer's name.

    optimizer = build_optimizer(model, cfg.optim, "cuda")     # optimizer.kind: its config entry
    optimizer_flops_per_step(cfg.optim.name, model)           # Muon's orthogonalisations; 0 for AdamW
    update_norm(optimizer, skipped)                           # ||delta theta|| of the step just taken

A new optimizer is its module here (build, update_norm, implementation; flops_per_step where its step
adds matrix FLOPs) plus one entry in config/optimizers.py's OPTIMIZERS, which names the module and holds
what is known before anything is built (the auto recipe, moment bits, FSDP support).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from pretrainer.config.optimizers import OPTIMIZERS, OptimizerEntry
from pretrainer.config.schema import OptimConfig
from pretrainer.core.errors import UserError
from pretrainer.optim.adamw import param_groups

__all__ = ["OPTIMIZERS", "build_optimizer", "describe_optimizer", "optimizer_entry", "update_norm"]


def optimizer_entry(name: str) -> OptimizerEntry:
    """OPTIMIZERS[name], or one line naming the choices (a config built in code skips the loader's check)."""
    if name not in OPTIMIZERS:
        choices = ", ".join(OPTIMIZERS)
        raise UserError(f"optim.name = {name!r} is not an optimizer here; choose one of {choices}")
    return OPTIMIZERS[name]


def optimizer_module(entry: OptimizerEntry) -> ModuleType:
    """The module that builds and measures it (imported on first use: torchao is an optional extra)."""
    return importlib.import_module(entry.module)


def optimizer_flops_per_step(name: str, model: nn.Module) -> int:
    """The matrix FLOPs its step adds beyond the model's (Muon's orthogonalisations), else 0."""
    entry = optimizer_entry(name)
    return optimizer_module(entry).flops_per_step(model) if entry.extra_flops else 0


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str, compile_step: bool = False
) -> torch.optim.Optimizer:
    """cfg.name's optimizer over the model's parameter groups (weight decay on matrices only). Every
    optimizer here takes `optimizer.found_inf`, a device tensor that skips the whole update (parameters,
    moments, step count) without a host sync, as fused AdamW does; the loop uses it to keep non-finite
    and flagged steps away from the weights. The low-bit ones' update is compiled on CUDA or when
    `compile_step`."""
    if cfg.lr <= 0:  # optim.lr = auto is a number only once config/resolve.py has seen the model
        raise ValueError("optim.lr is auto (0): build the optimizer from a resolved config")
    entry = optimizer_entry(cfg.name)
    groups = param_groups(model, cfg.weight_decay, cfg.embedding_lr_scale)
    compile_step = compile_step or device_type == "cuda"
    optimizer = optimizer_module(entry).build(groups, model, cfg, entry=entry, compile_step=compile_step)
    optimizer.kind = entry
    return optimizer


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict:
    """What the report records about the optimizer (its state's size is measured at each checkpoint)."""
    return {
        "name": optimizer.kind.name,
        "implementation": optimizer_module(optimizer.kind).implementation(optimizer),
    }


def update_norm(optimizer: torch.optim.Optimizer, skipped: torch.Tensor | None = None) -> torch.Tensor:
    """||delta theta|| of the step just taken, as the optimizer's own module measures it."""
    entry = getattr(optimizer, "kind", OPTIMIZERS["adamw"])  # a torch.optim.AdamW made by hand
    return optimizer_module(entry).update_norm(optimizer, skipped)
