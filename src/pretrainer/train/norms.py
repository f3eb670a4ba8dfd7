"""Norms the loop logs: of the weights, of the last update, and of the gradients per layer group
(measured by the trainer before clipping, on the logging steps spike.layer_norms_every asks for)."""

from __future__ import annotations

import torch

from pretrainer.optim.registry import update_norm
from pretrainer.train.component import Component, Step


class Norms(Component):
    """On logging steps: the parameter norm, the update's size relative to it, the per-group gradient
    norms. Collectives under FSDP2: every rank logs the same steps."""

    name = "norms"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    @classmethod
    def build(cls, trainer) -> Norms:
        return cls(trainer.model, trainer.optimizer)

    def metrics(self, step: Step) -> dict:
        return {
            **weight_norms(self.model, update_norm(self.optimizer, step.skip)),
            **{f"grad_norm/{name}": value.item() for name, value in step.group_norms.items()},
        }


# --- quantities the loop logs ---


def l2_norm(tensors) -> torch.Tensor:
    """Global L2 norm of several tensors; FSDP2 shards (DTensors) are reduced across ranks."""
    total = sum(t.detach().float().pow(2).sum() for t in tensors)
    return (total.full_tensor() if hasattr(total, "full_tensor") else total).sqrt()


def parameter_norm(model) -> torch.Tensor:
    return l2_norm(model.parameters())


def weight_norms(model, update_norm: torch.Tensor) -> dict[str, float]:
    """The parameter norm and the update's size relative to it (`update_norm`: ||delta theta|| of the
    step, as the optimizer's entry in optim/registry.py measures it). Collectives under FSDP2: every rank
    calls it."""
    param_norm, update = torch.stack([parameter_norm(model), update_norm.to(torch.float32)]).tolist()
    return {"param_norm": param_norm, "update_to_param": update / max(param_norm, 1e-12)}


def layer_group_grad_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradient norm per group (embeddings, each block, final norm): where a spike's gradient lives."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        group = (
            "embeddings"
            if name.startswith(("wte", "wpe"))
            else ".".join(name.split(".")[:2])
            if name.startswith("layers.")
            else "final"
        )
        groups.setdefault(group, []).append(p.grad)
    return {group: l2_norm(grads) for group, grads in groups.items()}
