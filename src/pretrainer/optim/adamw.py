"""AdamW (optim.name = "adamw": torch's fused AdamW, fp32 moments) and the parts every optimizer here shares:
weight decay on matrices only, and the size of an Adam update from its state (8-/4-bit moments:
optim/lowbit.py; the table of optimizers: config/optimizers.py).

Weight decay applies to the weight matrices of Linear layers. Norm weights, biases and embeddings
(token and position) are not decayed: decaying them pulls gains toward zero and rare tokens'
embeddings toward the origin, with no regularising benefit (GPT-3, nanoGPT, OLMo).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrainer.config.schema import OptimConfig
from pretrainer.optim.sizes import _plain


def param_groups(model: nn.Module, weight_decay: float, embedding_lr_scale: float = 1.0) -> list[dict]:
    """Decayed matrices, then the rest (norms, biases, embeddings). embedding_lr_scale != 1: the
    embeddings (a tied head with them) in a third group whose lr is that multiple of the schedule's
    (optim/schedule.set_lr reads "lr_scale"); at 1 there is no third group, as before the switch, so
    optimizer states saved then still load."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, embeddings = [], [], []
    for _, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        if id(p) in embedding_params and embedding_lr_scale != 1.0:
            embeddings.append(p)
        else:
            (decay if p.dim() >= 2 and id(p) not in embedding_params else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if embeddings:
        groups.append({"params": embeddings, "weight_decay": 0.0, "lr_scale": embedding_lr_scale})
    return groups


@torch.no_grad()
def adamw_update_norm(optimizer: torch.optim.Optimizer, skipped: torch.Tensor | None = None) -> torch.Tensor:
    """||delta theta|| of the AdamW step just taken, from the optimizer's state alone: no copy of the weights
    before the step (4 bytes per parameter, 4.6 GiB at 1.2B). AdamW does
        theta' = theta (1 - lr wd) - lr a,   a = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    so delta = theta' - theta = -lr (a + wd theta') / (1 - lr wd). One parameter at a time: the extra
    memory is about twice the largest parameter. Quantised moments enter dequantised: the step
    used them before re-quantising, so the norm is within that quantisation error of the applied update. A
    skipped update (`skipped` = 1, fused AdamW's
    found_inf) changed nothing: its norm is 0. Under FSDP2 the shards' sums are reduced (a collective)."""
    total = None
    for group in optimizer.param_groups:
        lr, weight_decay, (beta1, beta2), eps = (
            group["lr"],
            group["weight_decay"],
            group["betas"],
            group["eps"],
        )
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            step = state["step"]
            if torch.is_tensor(step) and step.device.type == "cpu":  # torchao's: a number, not a GPU copy
                step = step.item()
            denominator = (_plain(state["exp_avg_sq"]) / (1 - beta2**step)).sqrt_().add_(eps)
            update = (_plain(state["exp_avg"]) / (1 - beta1**step)).div_(denominator)
            del denominator
            if beta1**2 < beta2:  # no applied element exceeds Adam's bound; dequantised 8-/4-bit moments can
                # (a second moment rounded toward 0 in a block of large ones): clamped to it
                bound = (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1**2 / beta2))
                bound = bound * (1 - beta2**step) ** 0.5 / (1 - beta1**step)  # a device tensor: no sync
                update.clamp_(-bound, bound)
            if weight_decay:
                update.add_(p.detach(), alpha=weight_decay)
            squares = update.float().pow(2).sum() * (lr / (1 - lr * weight_decay)) ** 2
            total = squares if total is None else total + squares
    if total is None:  # no step taken yet (the first skipped): a zero where the weights are, not on the CPU
        device = next((p.device for group in optimizer.param_groups for p in group["params"]), None)
        return torch.zeros((), device=device)
    norm = (total.full_tensor() if hasattr(total, "full_tensor") else total).sqrt()
    if skipped is not None:  # (where, not a product: with no update ever taken the formula is 0/0)
        norm = torch.where(skipped.bool(), torch.zeros_like(norm), norm)
    return norm


# --- optim.name = "adamw" (config/optimizers.py's entry names this module) ---


def build(groups: list[dict], model: nn.Module, cfg: OptimConfig, *, entry, compile_step: bool):
    """Fused: one kernel per step, and it takes `optimizer.found_inf` (a device tensor that skips the
    whole update without a host sync)."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def implementation(optimizer: torch.optim.Optimizer) -> str:
    return f"torch.optim.AdamW, fused (torch {torch.__version__})"


update_norm = adamw_update_norm
