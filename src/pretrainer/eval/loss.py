"""Validation loss and bits per byte over a fixed set of validation batches.

evaluate(model, batches, device, amp_dtype, token_bytes)       # {"val_loss", "val_bpb"}
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from pretrainer.core.device import autocast, uncompiled
from pretrainer.model.loss import IGNORE_INDEX


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    token_bytes: torch.Tensor | None = None,
    *,
    doc_separator: int | None = None,
) -> dict[str, float]:
    """Over a fixed set of batches: {"val_loss": mean loss per counted target} and, given `token_bytes`
    (the UTF-8 bytes of each token id, Tokenizer.token_byte_lengths), {"val_bpb": bits per byte} = the
    nats of the scored tokens / (ln 2 x their bytes), special tokens (0 bytes) left out of both. Unlike
    the loss, bits per byte compare models with different tokenizers. Targets outside the loss mask
    (IGNORE_INDEX) count in neither; doc_separator: document packing, as in training."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model.eval()
    # [sum of loss x counted targets, counted targets, nats of the bytes, bytes], summed on the device: one
    # host sync for the whole evaluation, not two per batch
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    lengths = token_bytes.to(device) if token_bytes is not None else None
    # each rank scores every world-th batch; every rank runs as many forwards (under FSDP2 each forward's
    # all-gathers are collectives), a rank short of one re-scoring a batch with weight 0
    full = len(batches[0][0]) if batches else 0
    for round_ in range(-(-len(batches) // world)):
        index = rank + round_ * world
        x, y = batches[index if index < len(batches) else 0]
        x, y, weight = x.to(device), y.to(device), float(index < len(batches))
        # a partial last batch runs eagerly: its shape compiles no graph (see core/device.uncompiled)
        with autocast(device, amp_dtype), uncompiled() if len(x) < full else contextlib.nullcontext():
            losses, loss = model(x, y, per_token=True, doc_separator=doc_separator)
        counted = (y != IGNORE_INDEX).sum().double() * weight
        totals[0] += loss.double() * counted
        totals[1] += counted
        if lengths is not None:
            target_bytes = lengths[y.clamp(min=0)] * (y != IGNORE_INDEX) * int(weight)
            totals[2] += (losses.double() * (target_bytes > 0)).sum()
            totals[3] += target_bytes.sum()
    if world > 1:
        dist.all_reduce(totals)
    # FSDP2 keeps the root's parameters gathered after a forward without backward
    if hasattr(model, "reshard"):
        model.reshard()
    model.train()
    loss_sum, n_targets, nats, n_bytes = totals.tolist()
    result = {"val_loss": loss_sum / max(n_targets, 1)}
    if lengths is not None:
        result["val_bpb"] = nats / (math.log(2) * max(n_bytes, 1))
    return result


def token_bytes_tensor(tokenizer, vocab_size: int) -> torch.Tensor:
    """Tokenizer.token_byte_lengths padded with 0 to the model's (possibly larger) vocabulary."""
    lengths = tokenizer.token_byte_lengths()
    return torch.tensor(lengths + [0] * (vocab_size - len(lengths)), dtype=torch.int64)
