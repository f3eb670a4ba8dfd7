"""The training loop, top to bottom: data -> model -> optimizer -> steps -> metrics and checkpoints.

    cfg = load_config("configs/tiny-cpu.toml", ["--data.dir=data/stdlib-bpe4k"])
    train(cfg)

One optimizer step reads micro_batch x grad_accum sequences of seq_len tokens, so
tokens_per_step = micro_batch x seq_len x grad_accum x world_size, counted exactly.
"""

from __future__ import annotations

import platform
import random
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pretrainer import __version__
from pretrainer.config import Config, ModelConfig, config_hash, diff_keys, from_dict, save_config, to_dict
from pretrainer.data.loader import DataDir, SequenceLoader, open_data_dir, validation_batches
from pretrainer.errors import RunStopped, UserError
from pretrainer.io import atomic_write_json
from pretrainer.flops import GPUS, flops_per_token, gpu_from_device_name, mfu, training_seconds
from pretrainer.metrics import MetricsLog, MlflowLogger, flat_config, hardware_info, l2_norm, parameter_norm, update_norm
from pretrainer.model import Transformer, count_parameters
from pretrainer.model.transformer import resolve_d_ff
from pretrainer.train.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, load_model_weights,
                                         model_weights, read_trainer_state, resolve_run_or_checkpoint, rng_state, save_checkpoint,
                                         set_rng_state)
from pretrainer.train.autobatch import find_micro_batch
from pretrainer.train.budget import ACTION_CODES, EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT, BudgetGuard, estimated_spend_usd
from pretrainer.train.spikes import SpikeInjector, SpikeMonitor, UnigramStats, unigram_counts
from pretrainer.train.distributed import (agree_max, barrier, full_state, full_tensor, gradient_sync, init_distributed,
                                          load_full_model_state, load_optimizer_state, mean_across_ranks, resolve_device, shutdown, wrap_model)
from pretrainer.train.optim import build_optimizer, lr_at


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
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a forward without backward
        model.reshard()
    model.train()
    return total_loss / total_tokens


class StopSignal:
    """SIGTERM / SIGINT (spot preemption, Ctrl-C): remember it, finish the step, checkpoint, exit.
    A second signal interrupts at once."""

    def __init__(self):
        self.signum, self.previous = 0, {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def layer_group_grad_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradient norm per group (embeddings, each block, final norm): where a spike's gradient lives."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        group = "embeddings" if name.startswith(("wte", "wpe")) else ".".join(name.split(".")[:2]) if name.startswith("layers.") else "final"
        groups.setdefault(group, []).append(p.grad)
    return {group: l2_norm(grads) for group, grads in groups.items()}


def launch_cost_check(cfg: Config, model_flops_per_token: float, steps_left: int, tokens_per_step: int, peak_tflops: float | None,
                      gpus: int, spent_before: float, say) -> None:
    """Refuse to start when the projected cost of the remaining steps exceeds budget.cap_usd."""
    if not cfg.budget.cap_usd:
        return
    if not peak_tflops:
        say("budget: no peak TFLOP/s for this device (set budget.peak_tflops); launch cost not projected")
        return
    seconds = training_seconds(model_flops_per_token * steps_left * tokens_per_step, gpus, peak_tflops, cfg.budget.mfu)
    projected = spent_before + estimated_spend_usd(cfg.budget.usd_per_gpu_hour, gpus, seconds)
    say(f"budget: projected ${projected:.2f} (cap ${cfg.budget.cap_usd:.2f}) for {steps_left:,} steps at MFU {cfg.budget.mfu:g}")
    if projected > cfg.budget.cap_usd and not cfg.budget.allow_over_cap:
        raise UserError(f"budget: the plan projects ${projected:.2f} for the remaining {steps_left:,} steps (MFU {cfg.budget.mfu:g}, "
                        f"${cfg.budget.usd_per_gpu_hour:g}/GPU-hour x {gpus}), over budget.cap_usd ${cfg.budget.cap_usd:.2f}; "
                        f"lower train.max_steps or pass --budget.allow_over_cap=true")


def device_peak_tflops(cfg: Config, device: torch.device) -> float | None:
    if cfg.budget.peak_tflops:
        return cfg.budget.peak_tflops
    if device.type == "cuda":
        key = gpu_from_device_name(torch.cuda.get_device_name(device))
        return GPUS[key].peak_bf16_tflops if key else None
    return None  # CPUs: no peak we trust, so no MFU


def train(cfg: Config, clock=time.time) -> dict:
    run_dir = Path(cfg.run.dir)
    env = init_distributed(cfg.train.device, cfg.parallel.timeout_s)  # rank, world size, device (torchrun or not)
    device, strategy = env.device, cfg.parallel.strategy
    say = print if env.is_main else (lambda *args, **kwargs: None)  # only rank 0 talks and writes
    metrics = sequences = tracker = progress = None
    status = "FAILED"
    stop = StopSignal()
    try:
        data = open_data_dir(cfg.data.dir)
        amp_dtype = autocast_dtype(cfg.train.dtype, device)
        checkpoint = find_resume_checkpoint(cfg, run_dir)

        # --- model (random init, or init.from when starting fresh), all ranks seeded alike ---
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg, data, load_init_weights=checkpoint is None)
        state = None
        if checkpoint is not None:  # full weights into the plain model, before any sharding
            weights, optimizer_state, state = load_checkpoint(checkpoint)
            saved_cfg = from_dict(state["config"], f"{checkpoint}/state.json")
            changed = diff_keys(saved_cfg, cfg)
            if any(k.startswith("model.") for k in changed):
                raise UserError(f"{checkpoint}: was trained with different model settings "
                                f"({', '.join(k for k in changed if k.startswith('model.'))}); use a new run.dir")
            if changed:
                say(f"note: resuming with changed config keys: {', '.join(changed)}")
            load_model_weights(model, weights, str(checkpoint))
        model.to(device)

        # --- batch: micro_batch x grad_accum x world_size sequences per step (global_batch fixes the product) ---
        if cfg.train.micro_batch == 0:  # auto: search GPU memory, keep the global batch
            per_rank = cfg.train.global_batch // env.world_size
            found = find_micro_batch(model, cfg, per_rank, device, amp_dtype, say)
            cfg.train.micro_batch = -agree_max([-found], env)[0]  # the smallest over ranks
        if cfg.train.global_batch:
            per_step = cfg.train.micro_batch * env.world_size
            if cfg.train.global_batch % per_step:
                raise UserError(f"train.global_batch = {cfg.train.global_batch} is not divisible by train.micro_batch x world size "
                                f"= {cfg.train.micro_batch} x {env.world_size}; pick a global batch that is a multiple of {per_step}")
            cfg.train.grad_accum = cfg.train.global_batch // per_step
        grad_accum = cfg.train.grad_accum

        model.checkpoint_blocks = cfg.train.activation_checkpointing  # torchtitan's order: checkpointing, compile, shard
        wrapped = wrap_model(model, strategy, env, amp_dtype)  # DDP or FSDP2 under torchrun; `model` itself otherwise
        compiled = torch.compile(wrapped) if cfg.train.compile else wrapped  # checkpoints read `model`: no _orig_mod. prefix
        optimizer = build_optimizer(model, cfg.optim, device.type)

        # --- data: every rank reads its own slice of each global step ---
        train_loader = SequenceLoader(data.tokens("train"), cfg.model.seq_len, cfg.train.micro_batch, grad_accum,
                                      env.world_size, env.rank, cfg.train.seed, where=f"{data.path}/train.bin")
        val_batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
        tokens_per_step = cfg.train.micro_batch * cfg.model.seq_len * grad_accum * env.world_size
        step, tokens_seen, elapsed_before = 0, 0, 0.0

        # --- resume: optimizer moments, data position, RNG, clock ---
        if state is not None:
            load_optimizer_state(wrapped, optimizer, optimizer_state)
            train_loader.load_state_dict(state["data"])
            step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
            set_rng_state(state["rng"])

        # --- spikes: detection always (on the device), injection drills when asked ---
        vocab_size = cfg.model.vocab_size
        unigram = UnigramStats(unigram_counts(data.path, data.tokens("train"), vocab_size,
                                              data.manifest["splits"]["train"]["sha256"]))
        monitor = SpikeMonitor(cfg.spike.window, cfg.spike.min_values, cfg.spike.sigmas, device)
        injector = SpikeInjector(cfg.spike, unigram, vocab_size, cfg.model.seq_len, cfg.train.seed) if cfg.spike.inject_at_step else None
        rollbacks, rollback_lr_until = 0, -1
        if state is not None and "spike" in state:
            monitor.load_state_dict(state["spike"]["monitor"])
            rollbacks = state["spike"]["rollbacks"]
            if injector is not None:
                injector.start_cursor = state["spike"]["injector_start_cursor"]

        counts = count_parameters(model)
        model_flops_per_token = flops_per_token(cfg.model, counts["non_embedding"])["total"]
        peak_tflops = device_peak_tflops(cfg, device)
        hardware = hardware_info(device, env.world_size)
        max_steps = cfg.train.max_steps
        end_step = min(max_steps, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else max_steps
        init_note = f", initialised from {cfg.init.from_}" if cfg.init.from_ and checkpoint is None else ""
        say(f"model: {cfg.model.arch}, {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding){init_note}")
        say(f"data: {data.path} ({train_loader.n_sequences:,} train sequences of {cfg.model.seq_len}, tokenizer {data.tokenizer.name})")
        say(f"tokens per step: {tokens_per_step:,} = {cfg.train.micro_batch} micro-batch x {cfg.model.seq_len} seq_len x "
            f"{grad_accum} grad_accum x {env.world_size} ranks; device {device}, {'bf16 autocast' if amp_dtype else 'float32'}"
            + (f", {strategy}" if env.world_size > 1 else ""))
        say(f"{'resuming from ' + str(checkpoint) if checkpoint else 'starting fresh'} at step {step} of {max_steps}; run dir {run_dir}")
        if step >= end_step:
            say(f"nothing to do: the run is already at step {step}")
            status = "FINISHED"
            return {"step": step, "tokens": tokens_seen}
        guard = BudgetGuard(cfg.budget, env.world_size, clock=clock) if cfg.budget.cap_usd and env.is_main else None
        spent_before = estimated_spend_usd(cfg.budget.usd_per_gpu_hour, env.world_size, elapsed_before)
        launch_cost_check(cfg, model_flops_per_token, end_step - step, tokens_per_step, peak_tflops, env.world_size, spent_before, say)

        if env.is_main:  # the run dir: config, tokenizer, metrics.jsonl, mlflow
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.toml")
            data.tokenizer.save(run_dir / "tokenizer")  # the run dir is self-contained for sampling and export
            atomic_write_json(run_dir / "unigram.json", {  # the training distribution, for post-mortems
                "bucket_edges": unigram.bucket_edges, "train_rank_histogram": unigram.train_rank_histogram(),
                "train_mean_log_prob": unigram.train_mean_log_prob, "rare_ids": unigram.rare_ids.tolist()})
            metrics = MetricsLog(run_dir / "metrics.jsonl", keep_through_step=step)
            tracker = open_tracker(cfg, run_dir, say)
        barrier(env)
        if cfg.log.sequences:
            sequences = MetricsLog(run_dir / f"sequences-rank{env.rank}.jsonl", keep_through_step=step)

        def log(record: dict) -> None:
            for sink in (metrics, tracker):
                if sink:
                    sink.write(record)

        def write_checkpoint() -> None:  # a collective: every rank gathers, rank 0 writes
            full_weights, full_optimizer = full_state(wrapped, optimizer)
            elapsed, monitor_state = elapsed_s(), monitor.state_dict()
            if env.is_main:
                weights = model_weights(model, full_weights)
                trainer_state = {"step": step, "tokens": tokens_seen, "tokens_per_step": tokens_per_step, "world_size": env.world_size,
                                 "strategy": strategy if env.world_size > 1 else "single", "elapsed_s": elapsed,
                                 "spent_usd": spent_usd(elapsed), "hardware": hardware,
                                 "data": train_loader.state_dict(), "rng": rng_state(), "config": to_dict(cfg),
                                 "spike": {"monitor": monitor_state, "rollbacks": rollbacks,
                                           "injector_start_cursor": injector.start_cursor if injector else None},
                                 "config_sha256": config_hash(cfg), "pretrainer_version": __version__,
                                 "torch_version": torch.__version__, "python_version": platform.python_version()}
                save_checkpoint(run_dir, step, weights, full_optimizer, trainer_state, cfg.ckpt.keep)
            barrier(env)

        def roll_back(flagged_step: int) -> bool:
            """Reload the newest checkpoint before the spike; keep the data going forward, past the bad window."""
            nonlocal step, tokens_seen, rollbacks, rollback_lr_until
            good = [c for c in list_checkpoints(run_dir) if int(c.name.split("-")[1]) < flagged_step]
            if not good or rollbacks >= cfg.spike.max_rollbacks:
                return False
            weights, optimizer_state, old = load_checkpoint(good[-1])
            load_full_model_state(wrapped, model, weights, env)
            load_optimizer_state(wrapped, optimizer, optimizer_state)
            skipped_from = train_loader.cursor
            train_loader.cursor += cfg.spike.rollback_skip_steps * train_loader.sequences_per_step
            step, tokens_seen = old["step"], old["tokens"]
            set_rng_state(old["rng"])
            rollbacks += 1
            rollback_lr_until = step + cfg.spike.rollback_lr_steps
            log({"step": flagged_step, "rollback": 1.0, "to_step": step, "skipped_sequences_from": skipped_from,
                 "skipped_sequences": train_loader.cursor - skipped_from, "elapsed_s": elapsed_s()})
            progress.n = step
            progress.write(f"spike at step {flagged_step}: rolled back to {good[-1].name}, skipping "
                           f"{cfg.spike.rollback_skip_steps} batches past the spike")
            return True

        t_start = time.time()
        elapsed_s = lambda: elapsed_before + time.time() - t_start  # noqa: E731  (wall clock over all resumes)
        budget_reading = None
        spent_usd = lambda elapsed: (budget_reading.spent_usd if budget_reading  # noqa: E731
                                     else estimated_spend_usd(cfg.budget.usd_per_gpu_hour, env.world_size, elapsed))
        if step == 0:
            val_loss = evaluate(compiled, val_batches, device, amp_dtype)
            log({"step": 0, "val_loss": val_loss, "tokens": 0, "elapsed_s": 0.0})
            say(f"step 0: val loss {val_loss:.4f}")

        progress = tqdm(total=max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0,
                        disable=not env.is_main)
        interval_start, interval_tokens, first_step = time.time(), tokens_seen, step
        last_loss = last_val = None
        stop.install()
        pending = []  # (step, lr, elapsed, batch stats, device values) since the last logging step: read there, one sync
        while step < end_step:
            lr = lr_at(step, cfg.optim, max_steps)
            logging_step = (step + 1) % cfg.log.every == 0 or step + 1 == end_step
            cursor = train_loader.cursor
            micro_batches = train_loader.next_step()
            if injector is not None and injector.active(step + 1, cursor, train_loader.sequences_per_step):
                micro_batches = injector.replace(micro_batches)
                lr *= injector.lr_factor()
                log({"step": step + 1, "spike_injected": 1.0, "inject_kind": cfg.spike.inject_kind, "data_cursor": cursor,
                     "lr": lr, "elapsed_s": elapsed_s()})
            if step < rollback_lr_until:
                lr *= cfg.spike.rollback_lr_factor
            for group in optimizer.param_groups:
                group["lr"] = lr

            # token ids outside the vocabulary never reach the embedding (the batch is on the CPU: no device sync)
            batch_ids = torch.cat([t.reshape(-1) for x, y in micro_batches for t in (x, y[:, -1:])]).numpy()
            invalid = int(batch_ids.max()) >= vocab_size or int(batch_ids.min()) < 0
            if agree_max([int(invalid)], env)[0]:
                log({"step": step + 1, "invalid_tokens": 1.0, "max_token_id": int(batch_ids.max()), "data_cursor": cursor,
                     "elapsed_s": elapsed_s()})
                if cfg.spike.action == "log":
                    raise UserError(f"step {step + 1}: token ids up to {int(batch_ids.max())} >= model.vocab_size {vocab_size} in "
                                    f"the batch at data position {cursor}: corrupted data, rejected before the embedding "
                                    f"(spike.action = skip or rollback drops such batches)")
                progress.write(f"step {step + 1}: batch with token ids outside the vocabulary dropped")
                continue
            batch_stats = unigram.batch_stats(batch_ids) if env.is_main else {}
            batch_ranks = unigram.rank_histogram(batch_ids[(batch_ids >= 0) & (batch_ids < vocab_size)]) if env.is_main else []
            before = [p.detach().clone() for p in model.parameters()] if logging_step else None  # for the update/param ratio

            # forward/backward over grad_accum micro-batches, gradients reduced across ranks on the last one only
            loss_sum = torch.zeros((), device=device)
            for micro_step, (x, y) in enumerate(micro_batches):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with gradient_sync(wrapped, strategy, env, sync=micro_step == grad_accum - 1):
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        _, loss = compiled(x, y)
                    (loss / grad_accum).backward()
                loss_sum += loss.detach()
            group_norms = (layer_group_grad_norms(model) if logging_step and cfg.spike.layer_norms_every
                           and (step + 1) % cfg.spike.layer_norms_every == 0 else {})
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"))

            # spikes: flagged on the device; non-finite steps never reach the weights, flagged ones neither under skip
            step_loss = mean_across_ranks(loss_sum / grad_accum, env)  # the same value on every rank, so the same decision
            flags = monitor.update(step_loss, full_tensor(grad_norm))
            spike_logged = False
            if cfg.spike.action == "rollback" and bool(flags.spike):  # rollback decides at once: a host sync per step
                log({"step": step + 1, "spike": 1.0, "spike_loss": step_loss.item(), "spike_grad_norm": full_tensor(grad_norm).item(),
                     "skipped": 1.0, "lr": lr, "elapsed_s": elapsed_s(),
                     "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), **batch_stats, "rank_histogram": batch_ranks})
                if roll_back(step + 1):
                    optimizer.zero_grad(set_to_none=True)
                    continue
                spike_logged = True  # no checkpoint to go back to: the update is skipped instead (below)
            skipped = flags.nonfinite | flags.spike if cfg.spike.action != "log" else flags.nonfinite
            optimizer.found_inf = skipped.float()  # fused AdamW skips the whole update when this is 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append((step + 1, lr, elapsed_s(), time.time(), batch_stats, batch_ranks,
                            torch.stack([step_loss.float(), full_tensor(grad_norm).float(),
                                         flags.spike.float() * (not spike_logged), skipped.float()])))
            step += 1
            tokens_seen += tokens_per_step
            progress.update(1)
            if sequences:
                sequences.write({"step": step, "ids": [i for micro in train_loader.last_step_ids for i in micro]})

            if logging_step:  # the same steps on every rank: the reductions below are collectives
                now, elapsed = time.time(), elapsed_s()
                last_loss = step_loss.item()  # .item() syncs: only on logging steps
                for (flagged_step, flagged_lr, flagged_at, wall_time, stats, ranks, values) in pending:  # spikes since the last log
                    loss_value, norm_value, spiked, was_skipped = values.tolist()
                    if spiked:
                        log({"step": flagged_step, "spike": 1.0, "spike_loss": loss_value, "spike_grad_norm": norm_value,
                             "skipped": was_skipped, "lr": flagged_lr, "elapsed_s": flagged_at,
                             "time_utc": datetime.fromtimestamp(wall_time, timezone.utc).isoformat(timespec="seconds"),
                             **stats, "rank_histogram": ranks})
                        progress.write(f"spike at step {flagged_step}: loss {loss_value:.3f}, grad norm {norm_value:.3f}"
                                       + (" (update skipped)" if was_skipped else ""))
                pending.clear()
                param_norm = parameter_norm(model).item()
                tokens_per_s = (tokens_seen - interval_tokens) / max(now - interval_start, 1e-9)
                record = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": full_tensor(grad_norm).item(),
                          "param_norm": param_norm, "update_to_param": update_norm(model, before).item() / max(param_norm, 1e-12),
                          "tokens": tokens_seen, "tokens_per_s": tokens_per_s, "elapsed_s": elapsed, "epoch": train_loader.epoch,
                          **batch_stats, **{f"grad_norm/{name}": value.item() for name, value in group_norms.items()}}
                if peak_tflops:
                    record["mfu"] = mfu(model_flops_per_token, tokens_per_s, peak_tflops, env.world_size)
                if device.type == "cuda":
                    record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                if cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour:
                    record["spent_usd"] = spent_usd(elapsed)
                log(record)
                progress.set_postfix_str(f"loss {last_loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
                interval_start, interval_tokens = now, tokens_seen
                del before

            if (cfg.eval.every and step % cfg.eval.every == 0) or step == max_steps:
                last_val = evaluate(compiled, val_batches, device, amp_dtype)  # every rank, the same batches
                log({"step": step, "val_loss": last_val, "tokens": tokens_seen, "elapsed_s": elapsed_s()})
                if env.is_main:
                    progress.write(f"step {step}: val loss {last_val:.4f}")
                interval_start = time.time()  # tokens/s measures training, not evaluation

            # --- stop requests: a signal on any rank, or the budget guard on rank 0; all ranks agree ---
            budget_action = 0
            if guard is not None:
                step_time = (time.time() - t_start) / max(step - first_step, 1)
                decision = guard.check(elapsed_s(), (max_steps - step) * step_time)
                if decision is not None:
                    budget_reading = decision.reading
                    if decision.reading.problem and decision.reading.problem not in guard.reported:
                        guard.reported.add(decision.reading.problem)
                        progress.write(f"budget: {decision.reading.problem}")
                        log({"step": step, "budget_problem": 1.0})
                    if decision.action != "ok":
                        progress.write(decision.message)
                        log({"step": step, f"budget_{decision.action}": 1.0, "spent_usd": decision.reading.spent_usd,
                             "projected_usd": decision.reading.projected_total_usd})
                    budget_action = ACTION_CODES[decision.action]
            budget_action, signum = agree_max([budget_action, stop.signum], env)  # one tiny all-reduce per step
            if budget_action == ACTION_CODES["halt"]:
                raise RunStopped(f"budget: spent over budget.cap_usd ${cfg.budget.cap_usd:.2f} at step {step}; "
                                 f"stopped without a checkpoint", EXIT_BUDGET_SPENT)
            if budget_action == ACTION_CODES["stop"] or signum:
                write_checkpoint()
                why = (f"budget: projected cost over budget.cap_usd ${cfg.budget.cap_usd:.2f}" if budget_action
                       else f"signal {signal.Signals(signum).name}")
                code = EXIT_BUDGET_PROJECTED if budget_action else 128 + signum
                raise RunStopped(f"{why}: checkpoint written at step {step}; run the same command to resume", code)

            if (cfg.ckpt.every and step % cfg.ckpt.every == 0) or step == end_step:
                write_checkpoint()
                interval_start = time.time()

        progress.close()
        stopped = "stopped early (train.stop_at_step)" if step < max_steps else "finished"
        say(f"{stopped} at step {step}: {tokens_seen:,} tokens, {time.time() - t_start:.1f}s; "
            f"checkpoint {run_dir / 'checkpoints' / f'step-{step:07d}'}")
        status = "FINISHED"
        return {"step": step, "tokens": tokens_seen, "loss": last_loss, "val_loss": last_val}
    except RunStopped:
        status = "KILLED"
        raise
    finally:
        if progress is not None:
            progress.close()
        stop.restore()
        for sink in (metrics, sequences):
            if sink:
                sink.close()
        if tracker:
            tracker.close(status)
        shutdown()


def open_tracker(cfg: Config, run_dir: Path, say):
    """mlflow when enabled and installed; None (metrics.jsonl only) otherwise."""
    if not cfg.mlflow.enabled:
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        say("note: mlflow is not installed (pip install -e '.[track]'); metrics go to metrics.jsonl only")
        return None
    config_text = (run_dir / "config.toml").read_text()
    return MlflowLogger(run_dir, cfg.mlflow.uri, cfg.mlflow.experiment, flat_config(to_dict(cfg)), config_text)


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
