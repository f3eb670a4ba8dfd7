"""Validation loss: the mean cross-entropy per token over a fixed set of validation batches.

    val_loss = evaluate(model, batches, device, amp_dtype)        # in the training loop
    evaluate_config(cfg)                                          # `pretrainer eval`: a run or init.from
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrainer.config import Config
from pretrainer.data.loader import open_data_dir, validation_batches
from pretrainer.device import autocast, autocast_dtype, resolve_device
from pretrainer.errors import UserError
from pretrainer.resolve import resolve
from pretrainer.runs import build_model, init_source
from pretrainer.train.checkpoint import latest_checkpoint


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, amp_dtype: torch.dtype | None) -> float:
    """Mean validation loss per token over a fixed set of batches."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device, amp_dtype):
            _, loss = model(x, y)
        total_loss += loss.item() * y.numel()
        total_tokens += y.numel()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a forward without backward
        model.reshard()
    model.train()
    return total_loss / total_tokens


def evaluate_config(cfg: Config) -> dict:
    """Validation loss of init.from weights, or of run.dir's newest checkpoint, on data.dir's val split."""
    data = open_data_dir(cfg.data.dir)
    device = resolve_device(cfg.train.device)
    spec = cfg.init.from_
    if not spec:
        checkpoint = latest_checkpoint(Path(cfg.run.dir))
        if checkpoint is None:
            raise UserError(f"{cfg.run.dir}: no checkpoint to evaluate; pass --init.from=hf:DIR or a trained --run.dir")
        spec = str(checkpoint)
    source_cfg, load_weights = init_source(spec)
    cfg = resolve(cfg, data=data, source=source_cfg, source_where=f"init.from={spec}")
    model = build_model(cfg, load_weights, f"init.from={spec}").to(device)
    batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
    val_loss = evaluate(model, batches, device, autocast_dtype(cfg.train.dtype, device))
    tokens = sum(y.numel() for _, y in batches)
    print(f"{spec}: val loss {val_loss:.4f} nats/token over {tokens:,} tokens of {data.path}/val.bin")
    return {"val_loss": val_loss, "tokens": tokens}
