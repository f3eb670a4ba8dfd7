"""What an optimizer's state takes: each optimizer's moments (their bits: config/optimizers.py), torchao's
block sizes (plan counts with the same numbers without importing torchao), the measured state of a live
optimizer."""

from __future__ import annotations

import math

import torch

from pretrainer.core.device import tensor_bytes

# torchao's quantised moments (optim/lowbit.py): values per fp32 block scale, lookup-table entries, and the
# size
# under which a tensor keeps fp32 moments (after bitsandbytes); here so plan needs no torchao
BLOCK_SIZE = {8: 256, 4: 128}
QMAP_ENTRIES = {8: 256, 4: 16}
MIN_QUANTISED_NUMEL = 4096


# torchao's; by name, so no torchao import here
QUANTISED_STATE_CLASSES = ("OptimState8bit", "OptimState4bit")


def is_quantised(tensor) -> bool:
    """A torchao quantised moment (not any tensor subclass: FSDP's DTensors are subclasses too)."""
    return type(tensor).__name__ in QUANTISED_STATE_CLASSES


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A quantised moment as the float tensor it stands for."""
    return tensor.dequantize() if is_quantised(tensor) else tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The measured size of the optimizer's state on this rank (quantised moments at their stored size)."""
    return sum(
        tensor_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def planned_state_bytes(
    kind, shapes: list[tuple[int, ...]], shards: int = 1, hidden: list[bool] | None = None
) -> int:
    """What an optimizer's state will take for parameters of these shapes, each split `shards` ways along
    dim 0 (FSDP; this rank's share is the larger one): the number plan's memory model uses. `kind`: its
    entry in config/optimizers.py (bits per moment; whether hidden matrices keep a momentum buffer only).
    `hidden`: which are the matrices Muon updates (optim/muon.is_hidden_matrix)."""
    bits = kind.moment_bits
    total = 0
    for i, shape in enumerate(shapes):
        numel = math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1
        if kind.hidden_momentum_only and hidden is not None and hidden[i]:
            total += 4 * numel  # the momentum buffer
            continue
        total += 4  # the step count, a float32 tensor per parameter
        if bits == 32:
            total += 2 * 4 * numel
            continue
        if numel < MIN_QUANTISED_NUMEL or numel % BLOCK_SIZE[bits]:
            total += 2 * 4 * numel
        else:
            total += 2 * (numel * bits // 8 + 4 * numel // BLOCK_SIZE[bits] + 4 * QMAP_ENTRIES[bits])
    return total
