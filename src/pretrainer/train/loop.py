"""The training loop, top to bottom: config -> model -> data -> guards -> steps -> metrics and checkpoints.

    cfg = load_config("configs/tiny-cpu.toml", ["--data.dir=data/stdlib-bpe4k"])
    train(cfg)

One optimizer step reads micro_batch x grad_accum sequences of seq_len tokens on each rank, so
tokens_per_step = micro_batch x seq_len x grad_accum x world_size, counted exactly.

The main path of a step is batch -> forward/backward -> clip -> step -> log -> eval -> checkpoint.
Everything else is asked of two guards with narrow interfaces: the spike guard (train/spikes.py:
drills, ids outside the vocabulary, skip or roll back) and the stopper (train/stopping.py: budget
and signals, agreed across ranks). What moves as the run trains is one TrainerState (train/state.py),
which is what checkpoints save and what resume and rollback restore.
"""

from __future__ import annotations

import platform
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pretrainer import __version__
from pretrainer.artifacts.checkpoint import latest_checkpoint, read_resume_checkpoint, weights_problem
from pretrainer.artifacts.metrics import MetricsLog
from pretrainer.artifacts.runs import InitSource, build_model, grow_vocabulary, open_init_source
from pretrainer.config.preflight import config_warnings, data_warnings
from pretrainer.config.resolve import resolve, resume_changes, tokens_per_step
from pretrainer.config.schema import Config, config_hash, save_config, to_dict
from pretrainer.core.device import autocast, autocast_dtype, device_peak_tflops, hardware_info
from pretrainer.core.errors import RunStopped, UserError
from pretrainer.core.files import atomic_write_json
from pretrainer.data.loader import SequenceLoader, open_training_data
from pretrainer.eval.inloop import LoopEvals
from pretrainer.model import count_parameters
from pretrainer.model.flops import flops_per_token
from pretrainer.optim.adamw import adamw_update_norm, build_optimizer, describe_optimizer
from pretrainer.optim.schedule import lr_at, set_lr
from pretrainer.optim.sizes import optimizer_state_bytes
from pretrainer.train.autobatch import find_micro_batch
from pretrainer.train.budget import launch_cost_check
from pretrainer.train.checkpoint import restore_checkpoint, write_checkpoint
from pretrainer.train.console import step_line
from pretrainer.train.distributed import (
    DistEnv,
    agree_max,
    barrier,
    broadcast_object,
    full_tensor,
    gradient_sync,
    init_distributed,
    keep_grads,
    load_full_state,
    mean_across_ranks,
    on_rank0,
    shutdown,
    wrap_model,
)
from pretrainer.train.norms import layer_group_grad_norms, weight_norms
from pretrainer.train.perf import SpeedMonitor, attention_backend
from pretrainer.train.spikes import SpikeGuard, UnigramStats, unigram_counts
from pretrainer.train.state import RunClock, TrainerState
from pretrainer.train.stopping import Stopper, StopSignal, exit_status, write_exit_record
from pretrainer.train.tracking import RunLog


def train(cfg: Config, clock=time.time) -> dict:
    """Train cfg's model on cfg's data in cfg.run.dir, resuming from its newest checkpoint.
    `clock` is the budget guard's (tests pass a fake one). -> the final step, tokens and losses."""
    run_dir = Path(cfg.run.dir)
    env = init_distributed(
        cfg.train.device, cfg.parallel.timeout_s
    )  # rank, world size, device (torchrun or not)
    device, strategy = env.device, cfg.parallel.strategy
    say = tqdm.write if env.is_main else (lambda *args, **kwargs: None)  # only rank 0 talks and writes
    signals = StopSignal()
    signals.install()  # from now on SIGTERM/SIGINT ask for a checkpoint and a clean exit
    run_log = sequences = evals = progress = state = failure = start_step = speed = None
    try:
        # --- config resolved against the data, the init source and the world; the checkpoint to resume ---
        data = open_training_data(
            cfg.data.dir, cfg.data.mixture
        )  # a prepared dir, or several mixed by weight
        amp_dtype = autocast_dtype(cfg.train.dtype, device)
        cfg, parent = resolve_for_training(
            cfg, data, env, amp_dtype, say
        )  # parent: init.from's weights and lineage
        resume = open_resume(cfg, run_dir, env, say)  # None when starting fresh

        # --- model: seeded alike on every rank, weights from the checkpoint or init.from, then wrapped ---
        model, wrapped, optimizer, attention = build_training_model(cfg, env, amp_dtype, resume, parent)

        # --- data: every rank reads its own slice of each global step; targets outside the loss mask are
        # ignored ---
        grad_accum, step_tokens = cfg.train.grad_accum, tokens_per_step(cfg, env.world_size)
        sources, weights = data.sources("train", cfg.model.seq_len, cfg.data.packing)
        loader = SequenceLoader(
            sources,
            cfg.model.seq_len,
            cfg.train.micro_batch,
            grad_accum,
            env.world_size,
            env.rank,
            cfg.train.seed,
            where=f"{data.path}/train.bin",
            pin_memory=device.type == "cuda",
            weights=weights,
        )
        separator = (
            data.eot_id if cfg.data.packing == "document" else None
        )  # attention stops at each document's end
        evals = LoopEvals(
            cfg, data, device, amp_dtype
        )  # val batches (bits per byte); eval.tasks read and tokenized once

        # --- what the run will do; refuse a launch the budget cannot pay for ---
        model_flops_per_token = flops_per_token(cfg.model, count_parameters(model)["non_embedding"])["total"]
        peak_tflops = device_peak_tflops(cfg.budget.peak_tflops, device)
        max_steps = cfg.train.max_steps
        end_step = min(max_steps, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else max_steps
        start_step, elapsed_before = (resume.state["step"], resume.state["elapsed_s"]) if resume else (0, 0.0)
        describe(
            cfg, model, data, loader, env, amp_dtype, resume, start_step, attention, say
        )  # and likely mistakes
        if start_step >= end_step:
            say(f"nothing to do: the run is already at step {start_step}")
            return {"step": start_step, "tokens": resume.state["tokens"] if resume else 0}
        launch_cost_check(
            cfg.budget,
            model_flops_per_token * (end_step - start_step) * step_tokens,
            end_step - start_step,
            env.world_size,
            peak_tflops,
            elapsed_before,
            say,
        )

        # --- the run dir, metrics, the guards, and the trainer state (restored on resume) ---
        run_log = RunLog(
            cfg, run_dir, start_step if resume else -1, env.is_main, say
        )  # cut back to the checkpoint's step
        run_clock = RunClock()
        spikes = SpikeGuard(
            cfg.spike,
            training_unigram(data, cfg.model.vocab_size),
            cfg.model.vocab_size,
            cfg.model.seq_len,
            cfg.train.seed,
            run_dir,
            env,
            run_log.write,
            say,
            run_clock.elapsed,
        )
        write_run_dir(cfg, data, spikes.unigram, run_dir, env)
        sequences = (
            MetricsLog(run_dir / f"sequences-rank{env.rank}.jsonl", start_step) if cfg.log.sequences else None
        )
        evals.attach(
            run_dir, start_step if resume else -1, env.is_main, run_log.write, say, run_clock.elapsed
        )
        stopper = Stopper(cfg.budget, env, signals, clock, run_log.write, say, resume_command(cfg, env))
        state = TrainerState(loader, spikes, run_clock, stopper.spent_usd)
        if resume is not None:  # step, tokens, data position, RNG, clock, spike monitor
            state.load_state_dict(resume.state)
        lineage = (
            resume.state.get("parent") if resume else parent.lineage if parent else None
        )  # the weights actually loaded
        run_info = run_metadata(
            cfg, env, hardware_info(device, env.world_size), data, lineage
        )  # state.json: what produced the run
        run_info["optimizer"] = describe_optimizer(optimizer, cfg.optim.name)

        def save() -> None:  # a collective: every rank gathers, rank 0 writes
            write_checkpoint(
                run_dir,
                state.step,
                wrapped,
                model,
                optimizer,
                cfg.ckpt.keep,
                env,
                lambda: {
                    **state.state_dict(),
                    **run_info,
                    "optimizer_state_bytes_rank0": optimizer_state_bytes(optimizer),
                },
            )
            state.saved_step = state.step

        run_clock.start()
        last_loss, last_val = (
            None,
            evals.validate(wrapped, 0, 0) if resume is None else None,
        )  # step 0's, once per run
        if cfg.eval.tasks_every and resume is None:
            evals.in_context(wrapped, model, 0, 0)
        progress = tqdm(
            total=max_steps,
            initial=state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            disable=True if not env.is_main else None,
        )  # None: a bar on a terminal only
        # tokens/s, MFU, data wait, host syncs between logging steps; the watchdog (too slow after warm-up:
        # diagnose)
        speed = SpeedMonitor(
            cfg,
            state.tokens,
            model_flops_per_token,
            peak_tflops,
            env.world_size,
            device,
            state.step,
            attention,
            say,
            run_log.write,
        )
        stopper.start(state.step, run_clock.started)
        while state.step < end_step:
            step = state.step + 1  # the step about to run, 1-based as in every log
            logging_step = step % cfg.log.every == 0 or step == end_step
            speed.start_step(step, logging_step)
            cursor = loader.cursor
            read = speed.read_batch(loader)
            micro_batches, lr = spikes.before_step(
                step, cursor, read, lr_at(state.step, cfg.optim, max_steps), loader.sequences_per_step
            )
            counts = (
                loader.last_step_counts
                if micro_batches is read
                else (  # a drill's batches: every target counts
                    [y.numel() for _, y in micro_batches],
                    loader.sequences_per_step * cfg.model.seq_len,
                )
            )
            set_lr(optimizer, lr)

            # the step's one agreement across ranks, on the host (no device sync): stop (signal, budget, too
            # slow), bad token ids
            budget_action, signum, slow, out_of_vocab = agree_max(
                stopper.local_view(state.step, run_clock.elapsed(), max_steps, cfg.parallel.hang_drill_step)
                + [speed.watchdog.stop_wanted, spikes.out_of_vocab(micro_batches)],
                env,
            )
            request = stopper.request(state.step, budget_action, signum, slow, speed.watchdog.message)
            if request is not None:  # this batch was not trained on: a resume reads it first
                stop_run(request, speed, loader, cursor, save if state.saved_step != state.step else None)
            if (
                out_of_vocab
            ):  # ids outside the vocabulary never reach the embedding: an error, or the batch is dropped
                speed.end_step()
                spikes.reject(step, cursor)
                continue

            step_loss = forward_backward(wrapped, micro_batches, counts, strategy, env, amp_dtype, separator)
            group_norms = (
                layer_group_grad_norms(model)
                if logging_step and cfg.spike.layer_norms_every and step % cfg.spike.layer_norms_every == 0
                else {}
            )
            grad_norm = full_tensor(
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
                )
            )

            # spikes: skip the update on the device (non-finite always), or roll back to a checkpoint before
            # the spike
            verdict = spikes.check(step, step_loss, grad_norm, lr)
            if verdict.roll_back_to is not None:
                state.rewind(restore_checkpoint(verdict.roll_back_to, wrapped, model, optimizer, env))
                spikes.rolled_back(step, verdict.roll_back_to, state.step, loader)
                progress.n = state.step
                optimizer.zero_grad(set_to_none=not keep_grads(strategy, env))
                continue
            optimizer.found_inf = verdict.skip  # the optimizer drops the whole update when this is 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads(strategy, env))  # DDP: its bucket views stay
            state.advance(step_tokens, counts[1])  # tokens seen; targets trained on (the loss mask's)
            progress.update(1)
            speed.end_step()  # logging, evaluation and checkpoints below may sync
            if sequences:
                sequences.write({"step": step, "ids": [i for micro in loader.last_step_ids for i in micro]})

            if logging_step:  # the same steps on every rank: the norms below may be collectives
                last_loss, last_grad_norm = torch.stack(
                    [step_loss, grad_norm]
                ).tolist()  # the host waits for the device: logging steps only
                elapsed, figures = (
                    run_clock.elapsed(),
                    speed.interval(state.tokens),
                )  # after the wait: the work is done
                spikes.flush()  # the flagged steps since the last log
                record = {
                    "step": step,
                    "loss": last_loss,
                    "lr": lr,
                    "grad_norm": last_grad_norm,
                    **weight_norms(model, adamw_update_norm(optimizer, verdict.skip)),
                    "tokens": state.tokens,
                    **figures,
                    "elapsed_s": elapsed,
                    "epoch": loader.epoch,
                    **({"trained_tokens": state.trained_tokens} if not loader.counts_every_target else {}),
                    **{f"mix_share/{name}": share for name, share in loader.shares().items()},
                    **spikes.batch_forensics(spikes.batch, histogram=False),
                    **{f"grad_norm/{name}": value.item() for name, value in group_norms.items()},
                }
                if cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour:
                    record["spent_usd"] = stopper.spent_usd(elapsed)
                run_log.write(record)
                say(step_line(record, end_step, step_tokens))
                speed.check(step, figures)  # the throughput watchdog, once after its warm-up

            if (cfg.eval.every and step % cfg.eval.every == 0) or step == max_steps:
                last_val = evals.validate(wrapped, step, state.tokens)  # every rank, the same batches
                speed.restart()  # tokens/s measures training, not evaluation

            if cfg.eval.tasks_every and (step % cfg.eval.tasks_every == 0 or step == max_steps):
                evals.in_context(wrapped, model, step, state.tokens)  # the task subset and the probes
                speed.restart()

            if (cfg.ckpt.every and step % cfg.ckpt.every == 0) or step == end_step:
                save()
                speed.restart()

        progress.close()
        say(closing_lines(cfg, env, state.step, state.tokens, time.time() - run_clock.started))
        return {"step": state.step, "tokens": state.tokens, "loss": last_loss, "val_loss": last_val}
    except BaseException as error:
        failure = error
        raise
    finally:  # whatever happened: close the sinks, then say why the run ended in RUN_DIR/exit.json
        end_run(
            run_dir,
            env,
            failure,
            state.step if state else start_step,
            run_log,
            speed,
            signals,
            progress,
            sequences,
            evals,
        )


def end_run(
    run_dir: Path,
    env: DistEnv,
    failure: BaseException | None,
    step: int | None,
    run_log: RunLog | None,
    *closing,
) -> None:
    """Close what the run opened (the signal handlers first), record why it ended (rank 0:
    RUN_DIR/exit.json) and leave the process group, even if closing something fails."""
    reason, exit_code = exit_status(failure)
    try:
        for thing in closing:
            if thing is not None:
                thing.close()
        if run_log is not None:
            run_log.close(reason)
    finally:
        try:
            if env.is_main:
                write_exit_record(run_dir, reason, exit_code, step, failure)
        finally:
            shutdown()


def forward_backward(
    wrapped: torch.nn.Module,
    micro_batches,
    counts: tuple[list[int], int],
    strategy: str,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
    separator: int | None = None,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, gradients reduced across ranks on the last
    one only. The step's loss is the mean over every counted target of the step, all micro-batches and
    ranks together: `counts` = (this rank's counted targets per micro-batch, the whole step's), so
    micro-batch k's mean is weighted by count_k x world size / step count (ranks average gradients).
    When every target counts this is 1 / grad_accum for each. -> the step's loss, the same on every rank."""
    local, step_count = counts
    uniform = (
        len(set(local)) == 1
    )  # every micro-batch counts the same targets: mean / grad_accum, as plain pretraining
    loss_sum = torch.zeros((), device=env.device)
    for micro_step, (x, y) in enumerate(micro_batches):
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        # how many times smaller this micro-batch's mean is than its share of the step's mean (inf: no counted
        # targets)
        divisor = step_count / (local[micro_step] * env.world_size) if local[micro_step] else float("inf")
        with gradient_sync(wrapped, strategy, env, sync=micro_step == len(micro_batches) - 1):
            with autocast(env.device, amp_dtype):
                _, loss = wrapped(x, y, doc_separator=separator)
            (loss / divisor).backward()
        loss_sum += loss.detach() if uniform else loss.detach() / divisor
    return mean_across_ranks(loss_sum / divisor if uniform else loss_sum, env)


def stop_run(request, speed: SpeedMonitor, loader: SequenceLoader, cursor, save) -> None:
    """Stop before the step: its batch goes back to the loader (a resume reads it first), a checkpoint
    is written when the request asks for one and `save` is given (None: the newest one is current)."""
    speed.end_step()
    loader.cursor = cursor
    if request.checkpoint and save is not None:
        save()
    raise RunStopped(request.message, request.exit_code, request.reason)


def resolve_for_training(cfg: Config, data, env: DistEnv, amp_dtype: torch.dtype | None, say):
    """-> (the resolved config, init.from's source (weights, tokenizer, lineage) or None). micro_batch =
    auto is searched on each rank's GPU and the ranks agree on the smallest. A run started from another
    run must read data made with that run's tokenizer (its ids mean the same; chat tokens may follow)."""
    parent = open_init_source(cfg.init.from_) if cfg.init.from_ else None
    if parent is not None and parent.tokenizer is not None and not data.tokenizer.extends(parent.tokenizer):
        raise UserError(
            f"{data.path}: tokenized by {data.tokenizer.name} ({data.tokenizer.sha256[:12]}), not by the "
            f"tokenizer "
            f"of init.from={cfg.init.from_} ({parent.tokenizer.name}, {parent.tokenizer.sha256[:12]}); "
            f"prepare "
            f"the data with --tokenizer-from {cfg.init.from_}"
        )
    search = lambda c, per_rank: (
        -agree_max([-find_micro_batch(c, per_rank, env.device, amp_dtype, say)], env)[0]
    )  # noqa: E731
    return resolve(
        cfg,
        env.world_size,
        data,
        parent.model if parent else None,
        f"init.from={cfg.init.from_}",
        search_micro_batch=search,
    ), parent


@dataclass
class Resume:
    checkpoint: Path
    weights: dict[str, torch.Tensor]
    optimizer_state: dict
    state: dict  # state.json: the trainer state and run metadata


def open_resume(cfg: Config, run_dir: Path, env: DistEnv, say) -> Resume | None:
    """The checkpoint train.resume picks (None: start fresh), verified and read on rank 0 only (past
    any damaged newer ones); every rank gets its trainer state. A changed model is refused."""
    found = on_rank0(
        lambda: read_resume_checkpoint(run_dir, cfg.train.resume, say),
        env,
        f"{run_dir}: cannot read a checkpoint",
    )
    checkpoint, state = broadcast_object((found[0], found[3]) if found else (None, None), env)
    if checkpoint is None:
        return None
    explicit = (
        f" --train.resume={shlex.quote(str(checkpoint))}" if cfg.train.resume not in ("auto", "never") else ""
    )
    changed = resume_changes(cfg, state["config"], checkpoint, resume_command(cfg, env) + explicit)
    if changed:
        say(f"note: resuming with changed config keys: {', '.join(changed)}")
    return Resume(checkpoint, *(found[1:3] if found else (None, None)), state)


def build_training_model(
    cfg: Config, env: DistEnv, amp_dtype: torch.dtype | None, resume: Resume | None, parent: InitSource | None
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, str]:
    """-> (the plain model, the model the step runs: DDP/FSDP2 under torchrun or the model itself, AdamW,
    the attention kernel SDPA picks for the run's shape), ready to continue. Every rank seeds alike, so
    random inits agree; weights (the checkpoint's, else
    init.from's, its vocabulary grown to the data's) are read on rank 0 and broadcast into the wrapped
    model, each rank keeping its part."""
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    where = str(resume.checkpoint) if resume else f"init.from={cfg.init.from_}"

    def read_weights() -> (
        dict | None
    ):  # the checkpoint's, else init.from's; checked name by name, shape by shape
        weights = (
            resume.weights
            if resume
            else grow_vocabulary(parent.load(), cfg.model.vocab_size)
            if parent
            else None
        )
        problem = weights_problem(model, weights, where) if weights is not None else ""
        if problem:
            raise UserError(problem)
        return weights

    weights = on_rank0(read_weights, env, f"{where}: cannot read the weights")
    model.to(env.device)
    attention = attention_backend(
        model, cfg.model.seq_len, env.device, amp_dtype
    )  # before sharding: on plain tensors
    model.configure_blocks(
        cfg.train.activation_checkpointing, cfg.train.compile
    )  # torchtitan's order: then shard
    wrapped = wrap_model(model, cfg.parallel.strategy, env, amp_dtype)
    optimizer = build_optimizer(model, cfg.optim, env.device.type, compile_step=cfg.train.compile)
    if resume is not None or parent is not None:  # AdamW moments too when resuming (name-keyed)
        load_full_state(
            wrapped,
            model,
            optimizer if resume else None,
            weights,
            resume.optimizer_state if resume else None,
            env,
        )
    if resume is not None:  # the host copies are in the model and optimizer now: free them
        resume.weights = resume.optimizer_state = None
    return model, wrapped, optimizer, attention


def run_metadata(cfg: Config, env: DistEnv, hardware: dict, data, parent: dict | None) -> dict:
    """What produced the checkpoints, saved in every state.json next to the trainer state: the data
    (tokenizer and split hashes), the run it started from (init.from: checkpoint, weights' sha256,
    tokens, and that run's parent), the config and its hash, the world, the hardware, the versions."""
    return {
        "dataset": data.provenance(),
        "parent": parent,
        "tokens_per_step": tokens_per_step(cfg, env.world_size),
        "world_size": env.world_size,
        "strategy": cfg.parallel.strategy if env.world_size > 1 else "single",
        "hardware": hardware,
        "config": to_dict(cfg),
        "config_sha256": config_hash(cfg),
        "pretrainer_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def describe(
    cfg: Config,
    model: torch.nn.Module,
    data,
    loader: SequenceLoader,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
    resume: Resume | None,
    start_step: int,
    attention: str,
    say,
) -> None:
    """The run in four lines: model, data, tokens per step, where it starts; then a line per likely
    mistake."""
    counts = count_parameters(model)
    checkpoint = resume.checkpoint if resume else None
    init_note = f", initialised from {cfg.init.from_}" if cfg.init.from_ and checkpoint is None else ""
    say(
        f"model: {cfg.model.arch}, {counts['total']:,} parameters ({counts['non_embedding']:,} "
        f"non-embedding){init_note}"
    )
    say(
        f"data: {data.path} ({loader.n_sequences:,} train sequences of {cfg.model.seq_len}, tokenizer "
        f"{data.tokenizer.name}, "
        f"packing {cfg.data.packing})"
    )
    for source in loader.sources:  # what chat data and padding leave out of the loss
        if source.mask is not None or source.packing == "pad":
            say(
                f"  {source.name}: loss on "
                f"{'assistant tokens only (loss mask)' if source.mask is not None else 'every token'}"
                + (
                    f"; padding {source.pad_fraction:.1%} of the sequences, {source.truncated:,} documents "
                    f"cut at seq_len"
                    if source.packing == "pad"
                    else ""
                )
            )
    say(
        f"tokens per step: {tokens_per_step(cfg, env.world_size):,} = {cfg.train.micro_batch} micro-batch x "
        f"{cfg.model.seq_len} seq_len x {cfg.train.grad_accum} grad_accum x {env.world_size} ranks; device "
        f"{env.device}, "
        f"{'bf16 autocast' if amp_dtype else 'float32'}, attention {attention}"
        + (", compiled per block" if cfg.train.compile else "")
        + (", activation checkpointing" if cfg.train.activation_checkpointing else "")
        + (f", {cfg.parallel.strategy}" if env.world_size > 1 else "")
    )
    say(
        f"{'resuming from ' + str(checkpoint) if checkpoint else 'starting fresh'} at step {start_step} of "
        f"{cfg.train.max_steps}; run dir {cfg.run.dir}"
    )
    for warning in config_warnings(cfg) + data_warnings(
        cfg, data, env.world_size, resume.state if resume else None
    ):
        say(f"warning: {warning}")


def resume_command(cfg: Config, env: DistEnv) -> str:
    """The command that continues this run (its saved config does the rest)."""
    return f"pretrainer train --run.dir={shlex.quote(cfg.run.dir)}" + (
        f" --nproc {env.world_size}" if env.world_size > 1 else ""
    )


def closing_lines(cfg: Config, env: DistEnv, step: int, tokens: int, wall_s: float) -> str:
    """How the run ended, where its checkpoint is, and what to run next."""
    how = "stopped early (train.stop_at_step)" if step < cfg.train.max_steps else "finished"
    return (
        f"{how} at step {step}: {tokens:,} tokens, {wall_s:.1f}s; checkpoint "
        f"{latest_checkpoint(Path(cfg.run.dir))}\n"
        + next_commands(cfg, env, finished=step >= cfg.train.max_steps)
    )


def next_commands(cfg: Config, env: DistEnv, finished: bool) -> str:
    """The run's last lines: what to do with it next, with its real (absolute) path."""
    run = shlex.quote(cfg.run.dir)
    then = "" if finished else f"\n  {resume_command(cfg, env)}        # continue the run"
    return (
        f'next:{then}\n  pretrainer sample {run} --prompt "..."   # generate text\n'
        f"  pretrainer eval {run}                   # val loss, bits per byte, tasks and probes of the "
        f"newest checkpoint\n"
        f"  pretrainer export {run}                 # report: manifest, metrics.csv, plots ({run}/report)\n"
        f"  pretrainer export {run} --format hf     # a transformers model ({run}/hf)"
    )


def training_unigram(data, vocab_size: int) -> UnigramStats:
    """Token statistics of the train split (cached in the cache dir): spike drills and batch forensics.
    A mixture's are its sources' frequencies mixed by weight, scaled to its train tokens."""
    counts = [
        unigram_counts(part.tokens("train"), vocab_size, part.manifest["splits"]["train"]["sha256"])
        for part in data.parts
    ]
    if len(counts) == 1:
        return UnigramStats(counts[0])
    mixed = sum(w * c / max(1, c.sum()) for w, c in zip(data.weights, counts)) / sum(data.weights)
    return UnigramStats(np.rint(mixed * data.manifest["splits"]["train"]["tokens"]).astype(np.int64))


def write_run_dir(cfg: Config, data, unigram: UnigramStats, run_dir: Path, env: DistEnv) -> None:
    """Rank 0 writes the resolved config, the tokenizer (the run dir is self-contained for sampling
    and export) and the training unigram distribution (for post-mortems); the others wait for it."""
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
        if not data.tokenizer.is_saved_in(run_dir / "tokenizer"):
            data.tokenizer.save(run_dir / "tokenizer")
        atomic_write_json(run_dir / "unigram.json", unigram.summary())
    barrier(env)
