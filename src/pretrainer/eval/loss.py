"""Validation loss and bits per byte over a fixed set of validation batches.

evaluate(model, batches, device, amp_dtype, token_bytes)       # {"val_loss", "val_bpb"}
"""

from __future__ import annotations

import math

import torch

from pretrainer.core.device import autocast
from pretrainer.model.loss import IGNORE_INDEX


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    token_bytes: torch.Tensor | None = None,
    doc_separator: int | None = None,
) -> dict[str, float]:
    """Over a fixed set of batches: {"val_loss": mean loss per counted target} and, given `token_bytes`
    (the UTF-8 bytes of each token id, Tokenizer.token_byte_lengths), {"val_bpb": bits per byte} = the
    nats of the scored tokens / (ln 2 x their bytes), special tokens (0 bytes) left out of both. Unlike
    the loss, bits per byte compare models with different tokenizers. Targets outside the loss mask
    (IGNORE_INDEX) count in neither; doc_separator: document packing, as in training."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    nats, n_bytes = (
        torch.zeros((), dtype=torch.float64, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
    )
    lengths = token_bytes.to(device) if token_bytes is not None else None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device, amp_dtype):
            losses, loss = model(x, y, per_token=True, doc_separator=doc_separator)
        counted = int((y != IGNORE_INDEX).sum())
        total_loss += loss.item() * counted
        total_tokens += counted
        if lengths is not None:
            target_bytes = lengths[y.clamp(min=0)] * (y != IGNORE_INDEX)
            nats += (losses.double() * (target_bytes > 0)).sum()
            n_bytes += target_bytes.sum()
    # FSDP2 keeps the root's parameters gathered after a forward without backward
    if hasattr(model, "reshard"):
        model.reshard()
    model.train()
    result = {"val_loss": total_loss / max(total_tokens, 1)}
    if lengths is not None:
        result["val_bpb"] = nats.item() / (math.log(2) * max(n_bytes.item(), 1))
    return result


def token_bytes_tensor(tokenizer, vocab_size: int) -> torch.Tensor:
    """Tokenizer.token_byte_lengths padded with 0 to the model's (possibly larger) vocabulary."""
    lengths = tokenizer.token_byte_lengths()
    return torch.tensor(lengths + [0] * (vocab_size - len(lengths)), dtype=torch.int64)
