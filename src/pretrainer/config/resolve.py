"""The one config resolution: what a config leaves to the data, the init source and the world.

    cfg = resolve(load_config(path, overrides), world_size=8, data=open_data_dir(data_dir))

`train`, `plan` and `eval` all call `resolve`; it returns a new config with model.vocab_size,
model.d_ff, train.micro_batch and train.grad_accum filled in and checked. Nothing else mutates a
config, and the tokens-per-step formula is written only here. `load_train_config` picks the config
a `train` launch starts from: a config file, or a run's saved one (`train --run.dir=R`).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pretrainer.config.keys import HORIZON_KEYS, diff_keys, flatten
from pretrainer.config.load import from_dict
from pretrainer.config.optimizers import OPTIMIZERS
from pretrainer.config.schema import Config, ModelConfig
from pretrainer.core.errors import NotThisRun, UserError
from pretrainer.core.hardware import MATMUL_ALIGNMENT


def resolve_d_ff(m: ModelConfig) -> int:
    if m.d_ff:
        return m.d_ff
    if m.arch == "gpt2" or m.mlp == "relu2":
        return 4 * m.d_model
    return 64 * math.ceil(8 * m.d_model / 3 / 64)  # SwiGLU keeps ~4*d^2*2 MLP params with three matrices


def uses_qk_norm(m: ModelConfig) -> bool:
    """model.qk_norm: auto is on for llama (the nanochat ablations: docs/benchmarks.md) and off for gpt2,
    which stays GPT-2 (its exports)."""
    return m.arch == "llama" if m.qk_norm == "auto" else m.qk_norm == "true"


def tokens_per_step(cfg: Config, world_size: int) -> int:
    """Tokens per optimizer step, counted exactly: micro_batch x seq_len x grad_accum x world size."""
    return cfg.train.micro_batch * cfg.model.seq_len * cfg.train.grad_accum * world_size


def model_shape(m: ModelConfig) -> dict[str, Any]:
    """The settings that decide which weights fit a model."""
    shape = {
        "arch": m.arch,
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_kv_head": m.n_kv_head or m.n_head,
        "d_ff": resolve_d_ff(m),
        "tie_embeddings": m.tie_embeddings,
        "norm_eps": m.norm_eps,
        "qkv_bias": m.arch == "gpt2" if m.qkv_bias == "auto" else m.qkv_bias == "true",
        "qk_norm": uses_qk_norm(m),  # a config saved before the switch reads as off (load.earlier_defaults)
    }
    if m.arch == "llama":
        shape["rope_theta"] = m.rope_theta
    else:
        shape["seq_len"] = m.seq_len  # the learned position table's size
    if m.mlp != "auto":
        shape["mlp"] = m.mlp
    return shape


def check_fits(model: ModelConfig, source: ModelConfig, where: str) -> None:
    """List every model setting that differs from the weights' source, in one error. A larger
    vocabulary fits: the new token rows are initialised (runs.grow_vocabulary)."""
    ours, theirs = model_shape(model), model_shape(source)
    problems = [
        f"model.{k} = {ours[k]} but the source has {theirs.get(k)}"
        for k in ours
        if ours[k] != theirs.get(k) and not (k == "vocab_size" and ours[k] > theirs[k])
    ]
    if problems:
        raise UserError(
            f"{where}: weights do not fit this model: {'; '.join(problems)}; set those model.* keys to match"
        )


class DataInfo(Protocol):  # what resolution reads of a prepared data dir (pretrainer.data.data_dir.DataDir)
    path: Path
    manifest: dict

    @property
    def vocab_size(self) -> int: ...


def padded_vocab_size(vocab_size: int) -> int:
    """The vocabulary rounded up to a multiple of 128; the rows above the tokenizer's are never an input
    or a target (sampling never picks them; exports drop them)."""
    return -(-vocab_size // MATMUL_ALIGNMENT) * MATMUL_ALIGNMENT


def resolve(
    cfg: Config,
    world_size: int = 1,
    data: DataInfo | None = None,
    *,
    source: ModelConfig | None = None,
    source_where: str = "",
    search_micro_batch: Callable[[Config, int], int] | None = None,
    count_parameters: Callable[[ModelConfig], int] | None = None,
    horizon: bool = True,
) -> Config:
    """A copy of cfg with everything derived filled in, checked against the data and the world:
    model.vocab_size   0 -> the larger of the init source's and the data's, the data's padded to a multiple of
                       128; never smaller than the data's ids
    model.d_ff         0 -> the architecture's default
    model.qk_norm      auto -> true for llama, false for gpt2 (uses_qk_norm)
    data.packing       auto -> document for chat data, concat otherwise
    train.micro_batch  auto -> search_micro_batch(cfg, per-rank batch), a divisor of it
    train.grad_accum   global_batch / (micro_batch x world size) when global_batch is set
    train.max_steps    from the horizon key that is set (resolve_horizon); count_parameters(model config)
                       -> total parameters, for train.tokens_per_param (horizon=False: a trained
                       run's config read to evaluate or serve it keeps its steps)
    optim.lr           auto -> auto_lr(model.d_model, optim.name)
    optim.warmup_steps auto -> AUTO_WARMUP_FRACTION[optim.name] of train.max_steps
    """
    cfg = absolute_paths(cfg)
    m, t = cfg.model, cfg.train
    if m.vocab_size == 0:
        if source is None and data is None:
            raise UserError(
                "model.vocab_size is 0 (taken from the data); pass --data.dir=DIR (a prepared data dir) "
                "or set --model.vocab_size"
            )
        # the source's, grown to the data's when its tokenizer has more (chat) tokens appended; a size taken
        # from the data is padded to a multiple of 128 (GPT-2's 50,257 -> 50,304): the embedding and the
        # output projection are matmuls, and ragged sizes cost ~30% of their speed on tensor cores
        m.vocab_size = max(
            source.vocab_size if source is not None else 0, data.vocab_size if data is not None else 0
        )
        if source is None or m.vocab_size > source.vocab_size:
            m.vocab_size = padded_vocab_size(m.vocab_size)
    if source is not None:
        if m.qk_norm == "auto":  # continue the source as it was trained (an HF Llama, an older run: none)
            m.qk_norm = "true" if uses_qk_norm(source) else "false"
        check_fits(m, source, source_where)
    if data is not None and (m.vocab_size < data.vocab_size or data.manifest["max_token_id"] >= m.vocab_size):
        raise UserError(
            f"{data.path}/manifest.json: tokenizer/shard vocab mismatch: the data has vocab "
            f"{data.vocab_size} "
            f"(max id {data.manifest['max_token_id']}) but model.vocab_size = {m.vocab_size}; "
            f"leave model.vocab_size = 0 to take it from the data"
        )
    m.d_ff = resolve_d_ff(m)
    m.qk_norm = "true" if uses_qk_norm(m) else "false"
    if cfg.data.packing == "auto":  # chat data: no token sees or predicts across a conversation's end
        cfg.data.packing = "document" if data is not None and getattr(data, "is_chat", False) else "concat"
    if m.dropout and cfg.data.packing == "document":  # packing "auto" became document for chat data
        raise UserError(
            f"model.dropout = {m.dropout:g} with document packing (chat data packs by document): the "
            "document-masked attention kernel (flex attention) has no dropout; use model.dropout = 0 or "
            "data.packing = concat"
        )
    if t.micro_batch == 0:  # auto: the largest micro-batch that fits, keeping the global batch
        if search_micro_batch is None:
            raise UserError(
                "train.micro_batch = auto is found at launch on the GPU; set a number to plan, "
                "e.g. --train.micro_batch=8"
            )
        t.micro_batch = search_micro_batch(cfg, t.global_batch // world_size)
    if t.global_batch:
        per_step = t.micro_batch * world_size
        if t.global_batch % per_step:
            raise UserError(
                f"train.global_batch = {t.global_batch} is not divisible by train.micro_batch x world size "
                f"= {t.micro_batch} x {world_size}; pick a global batch that is a multiple of {per_step}"
            )
        t.grad_accum = t.global_batch // per_step
    if horizon:
        resolve_horizon(cfg, world_size, data, count_parameters)
    resolve_optim(cfg)
    return cfg


# lr ~ 1 / width: GPT-3's AdamW table (6e-4 at 768 .. 2e-4 at 2048), muP's hidden-layer rule under Adam;
# our two CPU widths cannot measure the slope (5e-3 at 192 did better than the rule's 3.3e-3 over 200 steps)
AUTO_LR_WIDTH_EXPONENT = 1.0


def auto_lr(d_model: int, optimizer: str = "muon") -> float:
    """optim.lr = auto: the optimizer's lr_at_width_128 (config/optimizers.py) x (128 / d_model) ^
    AUTO_LR_WIDTH_EXPONENT, to 2 significant figures (Muon: 5e-3 at 128, 8.3e-4 at 768, 3.1e-4 at 2,048;
    AdamW half of that)."""
    base = OPTIMIZERS[optimizer].lr_at_width_128
    return float(f"{base * (128 / d_model) ** AUTO_LR_WIDTH_EXPONENT:.2g}")


def resolve_optim(cfg: Config) -> None:
    """optim.lr, optim.warmup_steps and optim.embedding_lr_scale = auto -> the default recipe's, for this
    optimizer, width and horizon (a saved, resolved config holds the numbers)."""
    o = cfg.optim
    if o.lr == 0:
        o.lr = auto_lr(cfg.model.d_model, o.name)
    if o.embedding_lr_scale == 0:
        o.embedding_lr_scale = OPTIMIZERS[o.name].embedding_lr_scale
    if o.warmup_steps < 0 and cfg.train.max_steps:
        o.warmup_steps = round(OPTIMIZERS[o.name].warmup_fraction * cfg.train.max_steps)


def horizon_tokens(cfg: Config, data: DataInfo | None, count_parameters) -> tuple[str, float] | None:
    """(the horizon key, the tokens it asks for) when one other than train.max_steps is set, else None.
    None too when its tokens cannot be counted here (no data for epochs, no model for tokens per
    parameter) and train.max_steps already holds them: a saved, resolved config."""
    t = cfg.train
    given = horizon_keys_set(t)
    if len(given) > 1:
        raise UserError(
            f"{' and '.join(given)} are both set: a run has one horizon; keep one of "
            f"{', '.join(HORIZON_KEYS)}"
        )
    if not given:
        return None
    key = given[0]
    if key == "train.max_tokens":
        return key, float(t.max_tokens)
    if key == "train.tokens_per_param":
        if count_parameters is None:
            return None if t.max_steps else _cannot_count(key, "the model")
        return key, t.tokens_per_param * count_parameters(cfg.model)
    if data is None:
        return None if t.max_steps else _cannot_count(key, "data.dir (its train split)")
    return key, t.epochs * train_sequences(data, cfg.model.seq_len) * cfg.model.seq_len


def horizon_keys_set(train) -> list[str]:
    """The horizon keys other than train.max_steps that a config sets (a resolved one keeps its steps
    beside the key they came from)."""
    return [key for key in HORIZON_KEYS[1:] if getattr(train, key.split(".")[1])]


def horizon_units(steps: int, step_tokens: int, params: int, epoch_tokens: int) -> dict:
    """The horizon in every unit (epochs only when the epoch's tokens are known)."""
    tokens = steps * step_tokens
    units = {"steps": steps, "tokens": tokens, "tokens_per_param": tokens / params}
    return {**units, "epochs": tokens / epoch_tokens} if epoch_tokens else units


def horizon_line(h: dict) -> str:
    """horizon_units in one line, and where train.max_hours stops the run (when `h` says)."""
    line = f"{h['steps']:,} steps = {h['tokens']:,} tokens = {h['tokens_per_param']:.2f} tokens/parameter"
    line += f" = {h['epochs']:.3g} epochs" if "epochs" in h else ""
    if "max_hours_steps" in h:
        reached = "the horizon" if h["max_hours_steps"] >= h["steps"] else f"step {h['max_hours_steps']:,}"
        line += f"; train.max_hours = {h['max_hours']:g} stops at {reached} at the planned speed"
    elif h.get("max_hours"):
        line += f"; train.max_hours = {h['max_hours']:g}"
    return line


def _cannot_count(key: str, needs: str) -> None:
    raise UserError(f"{key} needs {needs} to become steps; set it, or set train.max_steps instead")


def train_sequences(data: DataInfo, seq_len: int) -> int:
    """Sequences of seq_len (and its next-token target) in the train split: one epoch's."""
    return (data.manifest["splits"]["train"]["tokens"] - 1) // seq_len


def resolve_horizon(cfg: Config, world_size: int, data: DataInfo | None, count_parameters) -> None:
    """train.max_steps from the one horizon key that is set: max_tokens, tokens_per_param x parameters
    or epochs x the train split, in tokens, rounded up to whole steps (tokens_per_step). A config that
    names steps and another horizon must agree on the steps."""
    t = cfg.train
    wanted = horizon_tokens(cfg, data, count_parameters)
    if wanted is None:
        if not t.max_steps:
            raise UserError(
                f"no horizon: set one of {', '.join(HORIZON_KEYS)} (e.g. --train.tokens_per_param=20, "
                f"Chinchilla's)"
            )
        return
    key, tokens = wanted
    steps = max(1, math.ceil(tokens / tokens_per_step(cfg, world_size)))
    if t.max_steps and t.max_steps != steps:
        raise UserError(
            f"train.max_steps = {t.max_steps:,} and {key} = {getattr(t, key.split('.')[1]):g} "
            f"({steps:,} steps) disagree: a run has one horizon; set train.max_steps = 0 or drop {key}"
        )
    t.max_steps = steps


def absolute_paths(cfg: Config) -> Config:
    """A copy of cfg whose paths (data.dir, run.dir, init.from, budget.file) are absolute, so a saved
    config works from any directory."""
    cfg = copy.deepcopy(cfg)
    # not resolve(): keep symlinks
    # a hub repo (hf://ORG/NAME) is not a path
    absolute = lambda p: os.path.abspath(os.path.expanduser(p)) if p and "://" not in p else p
    cfg.data.dir, cfg.run.dir, cfg.budget.file = (
        absolute(cfg.data.dir),
        absolute(cfg.run.dir),
        absolute(cfg.budget.file),
    )
    cfg.data.mixture = [{**source, "dir": absolute(source["dir"])} for source in cfg.data.mixture]
    spec = cfg.init.from_
    cfg.init.from_ = (
        "hf:" + absolute(spec[3:])
        if spec.startswith("hf:") and not spec.startswith("hf://")
        else absolute(spec)
    )
    return cfg


def resume_changes(cfg: Config, saved: dict, where: Path, resume_command: str) -> list[str]:
    """'key: old -> new' for each config key that differs from a checkpoint's (resolved) config (a run
    trained with an unpadded vocabulary keeps it: cfg's is set back). A different model is refused,
    naming each key with the value the checkpoint was trained with, and `resume_command`, which
    continues with the saved config."""
    saved_cfg = absolute_paths(from_dict(saved, f"{where}/state.json"))  # older runs saved relative paths
    # checkpoints written before d_ff was resolved hold 0
    saved_cfg.model.d_ff = resolve_d_ff(saved_cfg.model)
    # checkpoints written before data.packing existed: they packed by concatenation
    if saved_cfg.data.packing == "auto":
        saved_cfg.data.packing = "concat"
    saved_vocab = saved_cfg.model.vocab_size
    if cfg.model.vocab_size != saved_vocab and cfg.model.vocab_size == padded_vocab_size(saved_vocab):
        cfg.model.vocab_size = saved_vocab  # trained before vocabularies were padded: it keeps its own rows
    old, new = flatten(saved_cfg), flatten(cfg)
    changed = diff_keys(saved_cfg, cfg)
    # the model, and the optimizer whose state the checkpoint holds (8-bit moments are not AdamW's, nor the
    # reverse)
    # context extension: a RoPE model has no weight that depends on seq_len, so it may grow on resume (the
    # optimizer state and the data position carry over: SequenceLoader.load_state_dict)
    extends_context = cfg.model.arch == "llama" and cfg.model.seq_len > saved_cfg.model.seq_len
    if extends_context and (cfg.data.mixture or saved_cfg.data.mixture):
        raise UserError(
            f"{where}: a longer model.seq_len on resume (context extension) keeps the data position of one "
            f"data dir, not of a mixture's stream; resume at model.seq_len = {saved_cfg.model.seq_len}, or "
            f"start the longer phase from these weights with init.from"
        )
    model_keys = [
        k
        for k in changed
        if (k.startswith("model.") or k == "optim.name") and not (k == "model.seq_len" and extends_context)
    ]
    # the embeddings in a parameter group of their own or not: the optimizer state's layout differs
    scale = "optim.embedding_lr_scale"
    if scale in changed and (old[scale] == 1.0) != (new[scale] == 1.0):
        raise NotThisRun(
            f"{where}: was trained with {scale} = {old[scale]!r} (this launch: {new[scale]!r}), and its "
            f"optimizer state keeps the embeddings in {'the' if old[scale] == 1.0 else 'a'} "
            f"{'common' if old[scale] == 1.0 else 'separate'} parameter group; resume with "
            f"--{scale}={old[scale]!r}"
        )
    if model_keys:
        raise NotThisRun(
            f"{where}: was trained with "
            f"{', '.join(f'{k} = {old[k]!r} (this launch: {new[k]!r})' for k in model_keys)}. "
            f"To resume, drop those settings "
            f"(`{resume_command}` resumes with its saved config); to train a different model or with another "
            f"optimizer, use a new run.dir (init.from=RUN starts from its weights)"
        )
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in changed]
