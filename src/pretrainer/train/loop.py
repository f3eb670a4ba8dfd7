"""The training loop, top to bottom: data -> model -> optimizer -> steps -> metrics and checkpoints.

    cfg = load_config("configs/tiny-cpu.toml", ["--data.dir=data/stdlib-bpe4k"])
    train(cfg)

One optimizer step reads micro_batch x grad_accum sequences of seq_len tokens, so
tokens_per_step = micro_batch x seq_len x grad_accum x world_size, counted exactly.
"""

from __future__ import annotations

import contextlib
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pretrainer import __version__
from pretrainer.config import Config, ModelConfig, config_hash, diff_keys, from_dict, save_config, to_dict
from pretrainer.data.loader import DataDir, SequenceLoader, open_data_dir, validation_batches
from pretrainer.errors import UserError
from pretrainer.metrics import MetricsLog
from pretrainer.model import Transformer, count_parameters
from pretrainer.model.transformer import resolve_d_ff
from pretrainer.train.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, load_model_weights,
                                         model_weights, read_trainer_state, resolve_run_or_checkpoint, rng_state, save_checkpoint,
                                         set_rng_state)
from pretrainer.train.optim import build_optimizer, lr_at


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device = '{name}' but CUDA is not available; use --train.device=cpu")
    return device


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; plain float32 on CPU (bf16 matmuls there are slow and inexact)."""
    if name == "bfloat16" or (name == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def find_resume_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    if cfg.train.resume == "auto":
        return latest_checkpoint(run_dir)
    if cfg.train.resume == "never":
        if list_checkpoints(run_dir):
            raise UserError(f"{run_dir}: has checkpoints but train.resume = 'never'; use a new run.dir or resume=auto")
        return None
    return Path(cfg.train.resume)


def init_source(spec: str) -> tuple[ModelConfig, Callable[[], dict[str, torch.Tensor]]]:
    """`init.from` -> (the source's model config, a function that loads its weights under our names)."""
    from safetensors.torch import load_file

    if spec.startswith("hf:"):
        from pretrainer import hf

        directory = Path(spec[len("hf:"):])
        source_cfg = hf.read_hf_config(directory)
        return source_cfg, lambda: hf.from_hf_weights(source_cfg, hf.read_hf_weights(directory), spec)
    checkpoint = resolve_run_or_checkpoint(Path(spec))
    source_cfg = from_dict(read_trainer_state(checkpoint)["config"], str(checkpoint)).model
    return source_cfg, lambda: load_file(checkpoint / "model.safetensors")


def check_fits(model_cfg: ModelConfig, source_cfg: ModelConfig, where: str) -> None:
    """List every model setting that differs from the weights' source, in one error."""
    def shape(c: ModelConfig) -> dict:
        fields = {"arch": c.arch, "vocab_size": c.vocab_size, "d_model": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head,
                  "n_kv_head": c.n_kv_head or c.n_head, "d_ff": resolve_d_ff(c), "tie_embeddings": c.tie_embeddings,
                  "norm_eps": c.norm_eps}
        if c.arch == "llama":
            fields["rope_theta"] = c.rope_theta
        else:
            fields["seq_len"] = c.seq_len  # the learned position table's size
        return fields

    ours, theirs = shape(model_cfg), shape(source_cfg)
    problems = [f"model.{k} = {ours[k]} but the source has {theirs.get(k)}" for k in ours if ours[k] != theirs.get(k)]
    if problems:
        raise UserError(f"{where}: weights do not fit this model: {'; '.join(problems)}; set those model.* keys to match")


def build_model(cfg: Config, data: DataDir, load_init_weights: bool) -> Transformer:
    """Resolve the vocab (init source, else data), check it against the data, build the model and
    optionally load `init.from` weights. Mutates cfg.model.vocab_size when it is 0."""
    source_cfg, load_source = init_source(cfg.init.from_) if cfg.init.from_ else (None, None)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = source_cfg.vocab_size if source_cfg else data.vocab_size
    if source_cfg is not None:
        check_fits(cfg.model, source_cfg, f"init.from={cfg.init.from_}")
    if cfg.model.vocab_size < data.vocab_size or data.manifest["max_token_id"] >= cfg.model.vocab_size:
        raise UserError(f"{data.path}/manifest.json: tokenizer/shard vocab mismatch: the data has vocab {data.vocab_size} "
                        f"(max id {data.manifest['max_token_id']}) but model.vocab_size = {cfg.model.vocab_size}; "
                        f"leave model.vocab_size = 0 to take it from the data")
    model = Transformer(cfg.model)
    if load_source is not None and load_init_weights:
        load_model_weights(model, load_source(), f"init.from={cfg.init.from_}")
    return model


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, amp_dtype: torch.dtype | None) -> float:
    """Mean validation loss per token over a fixed set of batches."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            _, loss = model(x, y)
        total_loss += loss.item() * y.numel()
        total_tokens += y.numel()
    model.train()
    return total_loss / total_tokens


def train(cfg: Config) -> dict:
    run_dir = Path(cfg.run.dir)
    world_size, rank = 1, 0  # multi-process training arrives with train/distributed.py

    data = open_data_dir(cfg.data.dir)
    device = resolve_device(cfg.train.device)
    amp_dtype = autocast_dtype(cfg.train.dtype, device)
    checkpoint = find_resume_checkpoint(cfg, run_dir)

    # --- model (random init, or init.from when starting fresh), optimizer, data streams; all seeded ---
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, data, load_init_weights=checkpoint is None).to(device)
    optimizer = build_optimizer(model, cfg.optim, device.type)
    train_loader = SequenceLoader(data.tokens("train"), cfg.model.seq_len, cfg.train.micro_batch, cfg.train.grad_accum,
                                  world_size, rank, cfg.train.seed, where=f"{data.path}/train.bin")
    val_batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
    tokens_per_step = cfg.train.micro_batch * cfg.model.seq_len * cfg.train.grad_accum * world_size
    step, tokens_seen, elapsed_before = 0, 0, 0.0

    # --- resume: weights, optimizer moments, data position, RNG, clock ---
    if checkpoint is not None:
        weights, optimizer_state, state = load_checkpoint(checkpoint)
        saved_cfg = from_dict(state["config"], f"{checkpoint}/state.json")
        changed = diff_keys(saved_cfg, cfg)
        if any(k.startswith("model.") for k in changed):
            raise UserError(f"{checkpoint}: was trained with different model settings ({', '.join(k for k in changed if k.startswith('model.'))}); "
                            f"use a new run.dir")
        if changed:
            print(f"warning: resuming with changed config keys: {', '.join(changed)}")
        load_model_weights(model, weights, str(checkpoint))
        optimizer.load_state_dict(optimizer_state)
        train_loader.load_state_dict(state["data"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        set_rng_state(state["rng"])

    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.toml")
    data.tokenizer.save(run_dir / "tokenizer")  # the run dir is self-contained for sampling and export
    metrics = MetricsLog(run_dir / "metrics.jsonl", keep_through_step=step)
    compiled_model = torch.compile(model) if cfg.train.compile else model  # checkpoints save `model`: no _orig_mod. prefix

    counts = count_parameters(model)
    max_steps, grad_accum = cfg.train.max_steps, cfg.train.grad_accum
    end_step = min(max_steps, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else max_steps
    init_note = f", initialised from {cfg.init.from_}" if cfg.init.from_ and checkpoint is None else ""
    print(f"model: {cfg.model.arch}, {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding){init_note}")
    print(f"data: {data.path} ({train_loader.n_sequences:,} train sequences of {cfg.model.seq_len}, tokenizer {data.tokenizer.name})")
    print(f"tokens per step: {tokens_per_step:,} = {cfg.train.micro_batch} micro-batch x {cfg.model.seq_len} seq_len x "
          f"{grad_accum} grad_accum x {world_size} ranks; device {device}, {'bf16 autocast' if amp_dtype else 'float32'}")
    print(f"{'resuming from ' + str(checkpoint) if checkpoint else 'starting fresh'} at step {step} of {max_steps}; run dir {run_dir}")
    if step >= end_step:
        print(f"nothing to do: the run is already at step {step}")
        metrics.close()
        return {"step": step, "tokens": tokens_seen}

    def write_checkpoint() -> None:
        trainer_state = {"step": step, "tokens": tokens_seen, "tokens_per_step": tokens_per_step, "world_size": world_size,
                         "elapsed_s": elapsed_before + time.time() - t_start, "data": train_loader.state_dict(),
                         "rng": rng_state(), "config": to_dict(cfg), "config_sha256": config_hash(cfg),
                         "pretrainer_version": __version__, "torch_version": torch.__version__, "python_version": platform.python_version()}
        save_checkpoint(run_dir, step, model_weights(model), optimizer.state_dict(), trainer_state, cfg.ckpt.keep)

    t_start = time.time()
    if step == 0:
        val_loss = evaluate(compiled_model, val_batches, device, amp_dtype)
        metrics.write({"step": 0, "val_loss": val_loss, "tokens": 0, "elapsed_s": 0.0})
        print(f"step 0: val loss {val_loss:.4f}")

    progress = tqdm(total=max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)
    interval_start, interval_tokens = time.time(), tokens_seen
    last_loss = last_val = None
    while step < end_step:
        lr = lr_at(step, cfg.optim, max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # forward/backward over grad_accum micro-batches; the loss is their mean (equal token counts)
        loss_sum = torch.zeros((), device=device)
        for x, y in train_loader.next_step():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                _, loss = compiled_model(x, y)
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        progress.update(1)

        if step % cfg.log.every == 0 or step == end_step:
            now = time.time()  # .item() syncs the device: only on logging steps
            last_loss = (loss_sum / grad_accum).item()
            tokens_per_s = (tokens_seen - interval_tokens) / max(now - interval_start, 1e-9)
            metrics.write({"step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm.item(), "tokens": tokens_seen,
                           "tokens_per_s": tokens_per_s, "elapsed_s": elapsed_before + now - t_start, "epoch": train_loader.epoch})
            progress.set_postfix_str(f"loss {last_loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
            interval_start, interval_tokens = now, tokens_seen

        if (cfg.eval.every and step % cfg.eval.every == 0) or step == max_steps:
            last_val = evaluate(compiled_model, val_batches, device, amp_dtype)
            metrics.write({"step": step, "val_loss": last_val, "tokens": tokens_seen, "elapsed_s": elapsed_before + time.time() - t_start})
            progress.write(f"step {step}: val loss {last_val:.4f}")
            interval_start = time.time()  # tokens/s measures training, not evaluation

        if (cfg.ckpt.every and step % cfg.ckpt.every == 0) or step == end_step:
            write_checkpoint()
            interval_start = time.time()

    progress.close()
    metrics.close()
    stopped = "stopped early (train.stop_at_step)" if step < max_steps else "finished"
    print(f"{stopped} at step {step}: {tokens_seen:,} tokens, {time.time() - t_start:.1f}s; "
          f"checkpoint {run_dir / 'checkpoints' / f'step-{step:07d}'}")
    return {"step": step, "tokens": tokens_seen, "loss": last_loss, "val_loss": last_val}


def evaluate_config(cfg: Config) -> dict:
    """Validation loss of init.from weights, or of run.dir's newest checkpoint, on data.dir's val split."""
    data = open_data_dir(cfg.data.dir)
    device = resolve_device(cfg.train.device)
    if not cfg.init.from_:
        checkpoint = latest_checkpoint(Path(cfg.run.dir))
        if checkpoint is None:
            raise UserError(f"{cfg.run.dir}: no checkpoint to evaluate; pass --init.from=hf:DIR or a trained --run.dir")
        cfg.init.from_ = str(checkpoint)
    model = build_model(cfg, data, load_init_weights=True).to(device)
    batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
    val_loss = evaluate(model, batches, device, autocast_dtype(cfg.train.dtype, device))
    tokens = sum(y.numel() for _, y in batches)
    print(f"{cfg.init.from_}: val loss {val_loss:.4f} nats/token over {tokens:,} tokens of {data.path}/val.bin")
    return {"val_loss": val_loss, "tokens": tokens}
