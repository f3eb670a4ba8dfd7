"""Setting a run up before its first step: the config resolved against the data and the world, the checkpoint
to resume, the model (seeded, loaded, wrapped) and its optimizer, the run dir's files, and the start-up lines
that describe the run."""

from __future__ import annotations

import platform
import random
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Imported here, before any run clock starts, what every training process imports anyway: dynamo (a
# torch optimizer imports it when built: its param groups are added under torch._disable_dynamo) and
# torch.distributed.checkpoint (the first checkpoint's full state). ~1 s together, several the first
# time a fresh environment compiles their bytecode: as start-up they are billed to no run, and a plan
# --measure probe's start-up or first checkpoint carries no cost the run it predicts does not pay.
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401

from pretrainer import __version__
from pretrainer.artifacts.checkpoint import read_resume_checkpoint, weights_problem
from pretrainer.artifacts.runs import InitSource, build_model, grow_vocabulary, open_init_source
from pretrainer.config.keys import config_hash, save_config, to_dict
from pretrainer.config.resolve import resolve, resume_changes, tokens_per_step
from pretrainer.config.schema import Config
from pretrainer.core.device import autocast_dtype, compiles, device_peak_tflops, hardware_info
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_json
from pretrainer.data.data_dir import open_training_data
from pretrainer.data.loader import SequenceLoader
from pretrainer.data.unigram import UnigramStats
from pretrainer.data.verify import verify_data
from pretrainer.eval.inloop import LoopEvals
from pretrainer.model import count_parameters
from pretrainer.model.attention_probe import attention_backend
from pretrainer.model.flops import flops_per_token
from pretrainer.model.transformer import total_parameters
from pretrainer.optim.registry import build_optimizer, describe_optimizer, optimizer_flops_per_step
from pretrainer.train.autobatch import find_micro_batch
from pretrainer.train.console import resume_command
from pretrainer.train.describe import describe
from pretrainer.train.distributed import (
    DistEnv,
    agree_max,
    barrier,
    broadcast_object,
    load_full_state,
    on_rank0,
    wrap_model,
)
from pretrainer.train.memory import refuse_what_cannot_fit


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
        -agree_max([-find_micro_batch(c, per_rank, env.device, amp_dtype, say=say)], env)[0]
    )  # noqa: E731
    return resolve(
        cfg,
        env.world_size,
        data,
        source=parent.model if parent else None,
        source_where=f"init.from={cfg.init.from_}",
        search_micro_batch=search,
        count_parameters=total_parameters,
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
    if any(change.startswith("model.seq_len:") for change in changed):
        say(
            "note: context extension: the optimizer's state, the step and LR schedule, and the data position "
            "(in tokens) carry over to the longer sequences"
        )
    return Resume(checkpoint, *(found[1:3] if found else (None, None)), state)


def new_token_rows(parent: InitSource, data_vocab: int) -> int | None:
    """The source tokenizer's size when the data's tokenizer has more tokens (chat tokens appended): rows
    from there on start at the mean, also where the source had them as padding. None: nothing new."""
    if parent.tokenizer is not None and data_vocab > parent.tokenizer.vocab_size:
        return parent.tokenizer.vocab_size
    return None


def build_training_model(
    cfg: Config,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
    resume: Resume | None,
    parent: InitSource | None,
    *,
    say=None,
    data_vocab: int = 0,
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
            else grow_vocabulary(parent.load(), cfg.model.vocab_size, new_token_rows(parent, data_vocab))
            if parent
            else None
        )
        problem = weights_problem(model, weights, where) if weights is not None else ""
        if problem:
            raise UserError(problem)
        return weights

    weights = on_rank0(read_weights, env, f"{where}: cannot read the weights")
    model.to(env.device)
    # before sharding: on plain tensors
    attention = attention_backend(
        model, cfg.model.seq_len, env.device, amp_dtype, documents=cfg.data.packing == "document", say=say
    )
    # torchtitan's order: then shard
    compiled = compiles(cfg.train.compile, env.device)
    model.configure_blocks(cfg.train.activation_checkpointing, compiled)
    wrapped = wrap_model(model, cfg.parallel.strategy, env, amp_dtype, cfg.parallel.fsdp_shard)
    optimizer = build_optimizer(model, cfg.optim, env.device.type, compile_step=compiled)
    if cfg.model.dropout:  # the inits above agree; each rank draws its own dropout masks from here on
        torch.manual_seed(cfg.train.seed + 1 + env.rank)
    if resume is not None or parent is not None:  # AdamW moments too when resuming (name-keyed)
        load_full_state(
            wrapped,
            model,
            optimizer if resume else None,
            weights=weights,
            optimizer_state=resume.optimizer_state if resume else None,
            env=env,
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


@dataclass
class Start:
    """What the set-up leaves for the loop: the resolved config, its data and model, where it starts."""

    cfg: Config
    data: Any
    amp_dtype: torch.dtype | None
    parent: InitSource | None
    resume: Resume | None
    model: torch.nn.Module
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    attention: str
    loader: SequenceLoader
    separator: int | None
    evals: LoopEvals
    step_tokens: int
    model_flops_per_token: float
    peak_tflops: float | None
    end_step: int
    start_step: int
    elapsed_before: float


def set_up(cfg: Config, run_dir: Path, env: DistEnv, say) -> Start:
    """Everything before the run dir is written, in this order: the data, the config resolved
    against it, the init source and the world; the checkpoint to resume; the model (seeded,
    loaded, wrapped) and its optimizer; the loader; the evaluations; what the run will do, said."""
    device = env.device
    if device.type == "cpu" and cfg.train.threads:  # before anything computes: the sums split by it
        torch.set_num_threads(cfg.train.threads)
    # --- config resolved against the data, the init source and the world; the checkpoint to resume ---
    # a prepared dir, or several mixed by weight
    data = open_training_data(cfg.data.dir, cfg.data.mixture)
    # its bytes against the manifest's checksums (data.verify), so state.json's provenance is true
    data.verified = broadcast_object(
        on_rank0(lambda: verify_data(data, cfg.data.verify), env, f"{data.path}: cannot verify it"), env
    )
    amp_dtype = autocast_dtype(cfg.train.dtype, device)
    # parent: init.from's weights and lineage
    searched = cfg.train.micro_batch == 0  # auto: the search has tried real steps already
    cfg, parent = resolve_for_training(cfg, data, env, amp_dtype, say)
    if not searched:
        refuse_what_cannot_fit(
            cfg, env.world_size, device, env.local_world_size
        )  # before the model is allocated
    resume = open_resume(cfg, run_dir, env, say)  # None when starting fresh

    # --- model: seeded alike on every rank, weights from the checkpoint or init.from, then wrapped ---
    model, wrapped, optimizer, attention = build_training_model(
        cfg, env, amp_dtype, resume, parent, say=say, data_vocab=data.tokenizer.vocab_size
    )

    # --- data: every rank reads its own slice of each global step; targets outside the loss mask are
    # ignored ---
    grad_accum, step_tokens = cfg.train.grad_accum, tokens_per_step(cfg, env.world_size)
    sources, weights = data.sources("train", cfg.model.seq_len, cfg.data.packing)
    loader = SequenceLoader(
        sources,
        cfg.model.seq_len,
        cfg.train.micro_batch,
        grad_accum,
        world_size=env.world_size,
        rank=env.rank,
        seed=cfg.train.seed,
        where=f"{data.path} (train split)",
        pin_memory=device.type == "cuda",
        weights=weights,
        prefetch=cfg.data.prefetch,
    )
    # attention stops at each document's end
    separator = data.eot_id if cfg.data.packing == "document" else None
    # val batches (bits per byte); eval.tasks read and tokenized once
    evals = LoopEvals(cfg, data, device, amp_dtype)

    # --- what the run will do; refuse a launch the budget cannot pay for ---
    model_flops_per_token = flops_per_token(cfg.model, count_parameters(model)["non_embedding"])["total"]
    # Muon's orthogonalisations are work the run does: MFU and the budget count them
    model_flops_per_token += optimizer_flops_per_step(cfg.optim.name, model) / tokens_per_step(
        cfg, env.world_size
    )
    peak_tflops = device_peak_tflops(cfg.budget.peak_tflops, device)
    max_steps = cfg.train.max_steps
    end_step = min(max_steps, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else max_steps
    start_step, elapsed_before = (resume.state["step"], resume.state["elapsed_s"]) if resume else (0, 0.0)
    # and likely mistakes
    describe(
        cfg,
        model,
        data,
        loader=loader,
        env=env,
        amp_dtype=amp_dtype,
        resume=resume,
        start_step=start_step,
        attention=attention,
        say=say,
    )
    return Start(
        cfg,
        data,
        amp_dtype,
        parent,
        resume,
        model,
        wrapped,
        optimizer,
        attention,
        loader,
        separator,
        evals,
        step_tokens,
        model_flops_per_token,
        peak_tflops,
        end_step,
        start_step,
        elapsed_before,
    )


def run_record(
    cfg: Config, env: DistEnv, data, *, resume: Resume | None, parent: InitSource | None, optimizer
) -> dict:
    """What every state.json records besides the trainer state: what produced the run."""
    # the weights actually loaded
    lineage = resume.state.get("parent") if resume else parent.lineage if parent else None
    run_info = run_metadata(cfg, env, hardware_info(env.device, env.world_size), data, lineage)
    run_info["optimizer"] = describe_optimizer(optimizer)
    return run_info
