"""Validation loss: the mean cross-entropy per token over a fixed set of validation batches.

    val_loss = evaluate(model, batches, device, amp_dtype)        # in the training loop
    evaluate_target("runs/tiny", ["--eval.batches=50"])        # `pretrainer eval`: a run, a checkpoint or hf:DIR
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pretrainer.config import Config, canonical_key, load_config, parse_overrides
from pretrainer.data.loader import open_data_dir, validation_batches
from pretrainer.device import autocast, autocast_dtype, resolve_device
from pretrainer.errors import UserError
from pretrainer.resolve import resolve
from pretrainer.runs import build_model, init_source, open_run, with_overrides
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


def eval_config(target: str | None, overrides: list[str]) -> tuple[Config, str]:
    """-> (the config to evaluate with, the weights' spec). `target` is a run dir or checkpoint (its
    saved config: data, seq_len, batch), `hf:DIR`, a TOML config (the old form: init.from or run.dir
    in it), or None (init.from or run.dir from the overrides). The model's shape always comes from
    the weights; overrides may change anything else (data.dir, eval.batches, train.micro_batch, ...)."""
    cfg = None
    if target and target.endswith(".toml"):
        cfg = load_config(target, overrides)
        saved_in_run = Path(target).parent  # RUN/config.toml: that run's newest checkpoint, wherever it is now
        spec = str(saved_in_run) if latest_checkpoint(saved_in_run) else cfg.init.from_ or cfg.run.dir
    else:
        given = load_config(None, overrides, validated=False)
        run_dir_given = any(canonical_key(key) == "run.dir" for key, _ in parse_overrides(overrides))
        spec = target or given.init.from_ or (given.run.dir if run_dir_given else "")
        if not spec:
            raise UserError("eval: say what to evaluate: RUN_DIR_OR_CHECKPOINT or hf:DIR (e.g. pretrainer eval runs/tiny)")
    if not spec.startswith("hf:"):
        run = open_run(spec)
        spec = str(run.checkpoint)
        cfg = cfg or with_overrides(run.cfg, overrides)  # the run's data, seq_len and batch unless overridden
    cfg = cfg or load_config(None, overrides)
    source_cfg, _ = init_source(spec)
    model_overrides = [f"--{key}={value}" for key, value in parse_overrides(overrides) if key.startswith("model.")]
    cfg.model = with_overrides(Config(model=copy.deepcopy(source_cfg)), model_overrides).model  # the weights' shape
    return cfg, spec


def evaluate_target(target: str | None, overrides: list[str]) -> dict:
    """`pretrainer eval`: validation loss of a run's newest checkpoint, a checkpoint or hf:DIR weights
    on data.dir's val split (by default the data the run trained on)."""
    cfg, spec = eval_config(target, overrides)
    data = open_data_dir(cfg.data.dir)
    device = resolve_device(cfg.train.device)
    source_cfg, load_weights = init_source(spec)
    cfg = resolve(cfg, data=data, source=source_cfg, source_where=spec)
    model = build_model(cfg, load_weights, spec).to(device)
    batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
    val_loss = evaluate(model, batches, device, autocast_dtype(cfg.train.dtype, device))
    tokens = sum(y.numel() for _, y in batches)
    print(f"{spec}: val loss {val_loss:.4f} nats/token over {tokens:,} tokens of {data.path}/val.bin")
    return {"val_loss": val_loss, "tokens": tokens}
