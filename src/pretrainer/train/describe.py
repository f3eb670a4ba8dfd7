"""The start-up lines a run prints before its first step: model, data, tokens per step, where it starts, its
horizon, and likely mistakes (config/preflight.py)."""

from __future__ import annotations

import os

import torch

from pretrainer.config.preflight import config_warnings, data_warnings
from pretrainer.config.resolve import horizon_line, horizon_units, tokens_per_step
from pretrainer.config.schema import Config
from pretrainer.core.device import compiles
from pretrainer.core.hardware import cores_busy_elsewhere, usable_cores
from pretrainer.data.loader import SequenceLoader
from pretrainer.model import count_parameters
from pretrainer.train.distributed import DistEnv, strategy_name


def describe(
    cfg: Config,
    model: torch.nn.Module,
    data,
    *,
    loader: SequenceLoader,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
    resume,  # train/setup.py's Resume, or None for a fresh start (setup.py calls this)
    start_step: int,
    attention: str,
    say,
) -> None:
    """The run in five lines: model, data, tokens per step, where it starts, the horizon; then a line
    per likely mistake."""
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
        + (", compiled per block" if compiles(cfg.train.compile, env.device) else "")
        + (", activation checkpointing" if cfg.train.activation_checkpointing else "")
        + (
            f", {strategy_name(cfg.parallel.strategy, env, cfg.parallel.fsdp_shard)}"
            if env.world_size > 1
            else ""
        )
    )
    say(
        f"{'resuming from ' + str(checkpoint) if checkpoint else 'starting fresh'} at step {start_step} of "
        f"{cfg.train.max_steps}; run dir {cfg.run.dir}"
    )
    units = horizon_units(  # resolve turned the one given into steps; an epoch is the loader's
        cfg.train.max_steps,
        tokens_per_step(cfg, env.world_size),
        counts["total"],
        loader.n_sequences * cfg.model.seq_len,
    )
    say(f"horizon: {horizon_line({**units, 'max_hours': cfg.train.max_hours})}")
    saved_threads = resume.state.get("hardware", {}).get("cpu_threads") if resume else None
    if env.device.type == "cpu" and saved_threads and saved_threads != torch.get_num_threads():
        say(
            f"warning: this run trained with {saved_threads} CPU threads and resumes with "
            f"{torch.get_num_threads()}: on CPU the sums split differently, so it continues close to, not "
            f"bit-exactly like, an uninterrupted run; set OMP_NUM_THREADS={saved_threads} to continue exactly"
        )
    chosen = cfg.train.threads or "OMP_NUM_THREADS" in os.environ  # threads picked on purpose: no check
    if env.device.type == "cpu" and env.is_main and not chosen:
        crowded = crowded_cores_warning(torch.get_num_threads())
        if crowded:
            say(crowded)
    for warning in config_warnings(cfg) + data_warnings(
        cfg, data, env.world_size, resume.state if resume else None
    ):
        say(f"warning: {warning}")


def crowded_cores_warning(threads: int) -> str:
    """One line when other processes leave fewer free cores than torch has threads: each step then waits
    for a busy core (a 2-core machine with one busy ran the quickstart 11x slower); "" otherwise."""
    busy = cores_busy_elsewhere()
    if busy is None:
        return ""
    cores = usable_cores()
    free = max(1, round(cores - busy))
    if cores - busy >= threads - 0.5:
        return ""
    return (
        f"warning: other processes keep {busy:.1f} of this run's {cores} usable cores busy and torch runs "
        f"{threads} threads: each step waits for a busy core, often many times slower; while they run, "
        f"pass --train.threads={free} (or set OMP_NUM_THREADS={free})"
    )
