"""AdamW with weight decay on matrices only (fp32 moments, or 8-/4-bit ones: train/lowbit.py), and the
learning-rate schedules.

Weight decay applies to the weight matrices of Linear layers. Norm weights, biases and embeddings
(token and position) are not decayed: decaying them pulls gains toward zero and rare tokens'
embeddings toward the origin, with no regularising benefit (GPT-3, nanoGPT, OLMo).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrainer.config import OptimConfig
from pretrainer.device import tensor_bytes


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embedding_params else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {"adamw": 32, "adamw8bit": 8, "adamw4bit": 4}  # name -> bits per moment value
# torchao's quantised moments (train/lowbit.py): values per fp32 block scale, lookup-table entries, and the size
# under which a tensor keeps fp32 moments (after bitsandbytes); here so plan needs no torchao
BLOCK_SIZE = {8: 256, 4: 128}
QMAP_ENTRIES = {8: 256, 4: 16}
MIN_QUANTISED_NUMEL = 4096


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str, compile_step: bool = False) -> torch.optim.Optimizer:
    """Fused AdamW on CUDA and CPU: one kernel per step, and it takes `optimizer.found_inf`, a device
    tensor that skips the whole update (parameters, moments, step count) without a host sync; the
    loop uses it to keep non-finite and flagged steps away from the weights. adamw8bit / adamw4bit:
    the same groups and hyperparameters with quantised moments, honouring found_inf with one host
    sync (train/lowbit.py); their update is compiled on CUDA or when `compile_step`."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    from pretrainer.train import lowbit  # torchao: an optional extra

    return lowbit.build(groups, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, OPTIMIZERS[cfg.name],
                        compile_step=compile_step or device_type == "cuda")


def describe_optimizer(optimizer: torch.optim.Optimizer, name: str) -> dict:
    """What the report records about the optimizer (its state's size is measured at each checkpoint)."""
    if name == "adamw":
        return {"name": name, "implementation": f"torch.optim.AdamW, fused (torch {torch.__version__})"}
    import importlib.metadata

    return {"name": name, "implementation": f"torchao.optim.{type(optimizer).__name__} (torchao "
                                            f"{importlib.metadata.version('torchao')}), update "
                                            f"{'compiled' if optimizer.compile_step else 'eager'}"}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr into every group; torchao keeps lr as a tensor (a new float would recompile its step)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


QUANTISED_STATE_CLASSES = ("OptimState8bit", "OptimState4bit")  # torchao's; by name, so no torchao import here


def is_quantised(tensor) -> bool:
    """A torchao quantised moment (not any tensor subclass: FSDP's DTensors are subclasses too)."""
    return type(tensor).__name__ in QUANTISED_STATE_CLASSES


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A quantised moment as the float tensor it stands for."""
    return tensor.dequantize() if is_quantised(tensor) else tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The measured size of the optimizer's state on this rank (quantised moments at their stored size)."""
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


def planned_state_bytes(name: str, shapes: list[tuple[int, ...]], shards: int = 1) -> int:
    """What `name`'s state will take for parameters of these shapes, each split `shards` ways along dim 0
    (FSDP; this rank's share is the larger one): the number plan's memory model uses."""
    bits = OPTIMIZERS[name]
    total = 0
    for shape in shapes:
        numel = math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1
        total += 4  # the step count, a float32 tensor per parameter
        if bits == 32:
            total += 2 * 4 * numel
            continue
        if numel < MIN_QUANTISED_NUMEL or numel % BLOCK_SIZE[bits]:
            total += 2 * 4 * numel
        else:
            total += 2 * (numel * bits // 8 + 4 * numel // BLOCK_SIZE[bits] + 4 * QMAP_ENTRIES[bits])
    return total


def state_for_file(state: dict) -> dict:
    """An optimizer state dict with each quantised moment written as its plain parts, so optimizer.pt
    loads with torch.load(weights_only=True): {"tensor_subclass": class name, "tensors": {...}, "attributes": [...]}."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if is_quantised(value):
            names, attributes = value.__tensor_flatten__()
            return {"tensor_subclass": type(value).__name__, "tensors": {n: getattr(value, n) for n in names},
                    "attributes": [{"dtype": str(a).removeprefix("torch.")} if isinstance(a, torch.dtype)
                                   else {"shape": list(a)} if isinstance(a, torch.Size) else a for a in attributes]}
        return value
    return plain(state)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def state_from_file(state: dict) -> dict:
    """state_for_file's inverse; the classes come from train/lowbit.py's list, never from the file."""
    def rebuilt(value):
        if isinstance(value, dict) and "tensor_subclass" in value:
            from pretrainer.train.lowbit import STATE_CLASSES

            cls = STATE_CLASSES.get(value["tensor_subclass"])
            if cls is None:
                raise ValueError(f"unknown optimizer state class {value['tensor_subclass']!r}")
            attributes = [_dtype(a["dtype"]) if isinstance(a, dict) and "dtype" in a
                          else torch.Size(a["shape"]) if isinstance(a, dict) and "shape" in a else a for a in value["attributes"]]
            return cls.__tensor_unflatten__(value["tensors"], attributes, None, None)
        if isinstance(value, dict):
            return {k: rebuilt(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rebuilt(v) for v in value]
        return value
    return rebuilt(state)


@torch.no_grad()
def adamw_update_norm(optimizer: torch.optim.Optimizer, skipped: torch.Tensor | None = None) -> torch.Tensor:
    """||delta theta|| of the AdamW step just taken, from the optimizer's state alone: no copy of the weights
    before the step (4 bytes per parameter, 4.6 GiB at 1.2B). AdamW does
        theta' = theta (1 - lr wd) - lr a,   a = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    so delta = theta' - theta = -lr (a + wd theta') / (1 - lr wd). One parameter at a time: the extra
    memory is about twice the largest parameter. Quantised moments enter dequantised: the step
    used them before re-quantising, so the norm is within that quantisation error of the applied update. A skipped update (`skipped` = 1, fused AdamW's
    found_inf) changed nothing: its norm is 0. Under FSDP2 the shards' sums are reduced (a collective)."""
    total = None
    for group in optimizer.param_groups:
        lr, weight_decay, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            step = state["step"]
            denominator = (_plain(state["exp_avg_sq"]) / (1 - beta2 ** step)).sqrt_().add_(eps)
            update = (_plain(state["exp_avg"]) / (1 - beta1 ** step)).div_(denominator)
            del denominator
            if weight_decay:
                update.add_(p.detach(), alpha=weight_decay)
            squares = update.float().pow(2).sum() * (lr / (1 - lr * weight_decay)) ** 2
            total = squares if total is None else total + squares
    if total is None:
        return torch.zeros(())
    norm = (total.full_tensor() if hasattr(total, "full_tensor") else total).sqrt()
    if skipped is not None:  # (where, not a product: with no update ever taken the formula is 0/0)
        norm = torch.where(skipped.bool(), torch.zeros_like(norm), norm)
    return norm


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
