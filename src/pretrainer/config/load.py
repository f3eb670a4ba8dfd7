"""Reading a config: TOML files, dotted command-line overrides and saved configs (state.json) into the
dataclasses of pretrainer.config, each value checked against its field's type, then the whole config
checked (`validate`). Unknown keys are an error naming the valid keys closest in words and letters.

    cfg = load_config("configs/tiny-cpu.toml", ["--optim.lr=3e-4", "--train.max_steps", "200"])
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pretrainer.config.schema import Config, all_keys, canonical_key, key_help, to_dict
from pretrainer.config.suggest import suggest
from pretrainer.core.errors import UserError


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


BOOL_WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


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
        expected = (
            "[{dir, weight > 0}, ...] in TOML or DIR:WEIGHT,DIR:WEIGHT" if typ is list else typ.__name__
        )
        raise UserError(f"{where}: '{key}' must be {expected}, got {value!r}") from None


def _mixture(value: Any) -> list[dict]:
    """data.mixture from TOML ([{dir, weight}, ...]) or the command line ("DIR:WEIGHT,DIR:WEIGHT")."""
    if isinstance(value, str):
        value = [
            dict(zip(("dir", "weight"), item.rsplit(":", 1))) for item in value.split(",") if item.strip()
        ]
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
    [('optim.lr', '3e-4'), ('train.max_steps', '200'), ('train.compile', 'true')]: a bare boolean flag means
    true."""
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
        (
            m.d_model % m.n_head == 0,
            f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})",
        ),
        (
            m.n_kv_head == 0 or m.n_head % m.n_kv_head == 0,
            f"model.n_head ({m.n_head}) must be divisible by model.n_kv_head ({m.n_kv_head})",
        ),
        (
            m.arch == "llama" or m.n_kv_head in (0, m.n_head),
            "model.n_kv_head (grouped-query attention) needs model.arch = 'llama'",
        ),
        (m.seq_len > 0 and m.n_layer > 0, "model.seq_len and model.n_layer must be positive"),
        (
            t.micro_batch >= 0 and t.grad_accum > 0,
            "train.micro_batch must be positive or auto; train.grad_accum positive",
        ),
        (
            t.micro_batch > 0 or t.global_batch > 0,
            "train.micro_batch = auto needs train.global_batch (the batch it keeps)",
        ),
        (t.max_steps > 0, "train.max_steps must be positive"),
        (
            cfg.parallel.strategy in ("ddp", "fsdp"),
            f"parallel.strategy must be ddp or fsdp, got '{cfg.parallel.strategy}'",
        ),
        # FSDP2 shards the moments already; gathering and re-sharding quantised ones for checkpoints is not
        # tested here
        (
            o.name == "adamw" or cfg.parallel.strategy == "ddp",
            f"optim.name = {o.name} needs parallel.strategy = ddp "
            "(also for one process); with fsdp use optim.name = adamw",
        ),
        (
            cfg.parallel.timeout_s > 0 and cfg.parallel.shutdown_timeout_s > 0,
            "parallel.timeout_s and parallel.shutdown_timeout_s must be positive",
        ),
        (t.global_batch >= 0, "train.global_batch must be >= 0 (0: micro_batch x grad_accum x world size)"),
        (
            t.dtype in ("auto", "float32", "bfloat16"),
            f"train.dtype must be auto, float32 or bfloat16, got '{t.dtype}'",
        ),
        (
            o.name in ("adamw", "adamw8bit", "adamw4bit"),
            f"optim.name must be adamw, adamw8bit or adamw4bit, got '{o.name}'",
        ),
        (
            o.schedule in ("cosine", "wsd", "constant"),
            f"optim.schedule must be cosine, wsd or constant, got '{o.schedule}'",
        ),
        (0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]"),
        (0.0 < o.decay_fraction <= 1.0, "optim.decay_fraction must be in (0, 1]"),
        (
            cfg.ckpt.keep >= 2,
            f"ckpt.keep must be >= 2 so a torn write never leaves no checkpoint, got {cfg.ckpt.keep}",
        ),
        (cfg.log.every > 0, "log.every must be positive"),
        (
            cfg.budget.cap_usd >= 0 and cfg.budget.check_every_s > 0,
            "budget.cap_usd must be >= 0 and budget.check_every_s > 0",
        ),
        (
            not cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour > 0,
            "budget.cap_usd needs budget.usd_per_gpu_hour (the estimate, and the fallback when budget.json "
            "is missing or stale)",
        ),
        (0 < cfg.budget.mfu <= 1, "budget.mfu must be in (0, 1]"),
        (
            cfg.train.watchdog_action in ("warn", "stop"),
            f"train.watchdog_action must be warn or stop, got '{cfg.train.watchdog_action}'",
        ),
        (
            cfg.train.min_mfu >= 0 and cfg.train.min_tokens_per_s >= 0 and cfg.train.watchdog_steps >= 1,
            "train.min_mfu and train.min_tokens_per_s must be >= 0 and train.watchdog_steps >= 1",
        ),
        (
            cfg.spike.action in ("log", "skip", "rollback"),
            f"spike.action must be log, skip or rollback, got '{cfg.spike.action}'",
        ),
        (
            cfg.spike.inject_kind in ("rare", "lr", "data"),
            f"spike.inject_kind must be rare, lr or data, got '{cfg.spike.inject_kind}'",
        ),
        (
            cfg.spike.data_mode in ("constant", "out_of_range"),
            "spike.data_mode must be constant or out_of_range",
        ),
        (0 < cfg.spike.min_values <= cfg.spike.window, "spike.min_values must be in [1, spike.window]"),
        (
            cfg.spike.max_consecutive == 0 or cfg.spike.max_consecutive >= 2,
            "spike.max_consecutive must be 0 (off) or >= 2",
        ),
        (cfg.spike.rollback_margin_steps >= 0, "spike.rollback_margin_steps must be >= 0"),
        (cfg.eval.batches > 0, "eval.batches must be positive"),
        (
            cfg.data.packing in ("auto", "concat", "document", "pad"),
            f"data.packing must be auto, concat, document or pad, got '{cfg.data.packing}'",
        ),
        (not (cfg.data.dir and cfg.data.mixture), "set data.dir or data.mixture, not both"),
        (len(cfg.data.mixture) != 1, "data.mixture needs two or more sources (one source: data.dir)"),
        (
            cfg.eval.tasks_every >= 0
            and cfg.eval.tasks_items >= 0
            and cfg.eval.num_fewshot >= 0
            and cfg.eval.probe_tokens > 0,
            "eval.tasks_every, eval.tasks_items and eval.num_fewshot must be >= 0, eval.probe_tokens "
            "positive",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"config: {message}")


def from_dict(raw: dict[str, dict[str, Any]], where: str) -> Config:
    cfg = Config()
    for section, values in raw.items():
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value, where)
    return cfg
