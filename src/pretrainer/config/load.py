"""Reading a config: TOML files, dotted command-line overrides and saved configs (state.json) into the
dataclasses of pretrainer.config, each value checked against its field's type, then the whole config
checked (`validate`). Unknown keys are an error naming the valid keys closest in words and letters.

    cfg = load_config("configs/tiny-cpu.toml", ["--optim.lr=3e-4", "--train.max_steps", "200"])
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from pretrainer.config.keys import (
    AUTO_NUMBERS,
    EARLIER_DEFAULTS,
    HORIZON_KEYS,
    RENAMED_KEYS,
    SECRET_KEYS,
    SWITCH_KEYS,
    all_keys,
    canonical_key,
    flatten,
    key_allowed,
    key_help,
    to_dict,
)
from pretrainer.config.optimizers import OPTIMIZERS
from pretrainer.config.schema import Config
from pretrainer.config.suggest import suggest
from pretrainer.core.errors import STOP_SIGNAL_NAMES, UserError, stop_signal_names
from pretrainer.core.secrets import keep_secret, redact


def _short_help(key: str) -> str:
    return key_help()[key].split(";")[0]


def _unknown_key(key: str, where: str) -> UserError:
    if len(key) > 100:  # a pasted blob: no suggestions (their distance is quadratic), a cut name
        return UserError(f"{where}: unknown config key '{key[:60]}...' ({len(key):,} characters)")
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
    """A key a bare `--key` sets to true: a boolean, or a switch with an "auto" (train.compile)."""
    return (
        all_keys().get(canonical_key(key)) is bool
        or canonical_key(key) in SWITCH_KEYS
        or canonical_key(key) == "mlflow.enabled"  # earlier versions' switch (set_key reads it)
    )


MAX_INT = 2**62  # no count or size here comes near it; beyond it, tensors and seeds overflow
RANGE = re.compile(r"^(?:(>=|>) *(\S+)|([\[(]) *(\S+), *(\S+) *([\])]))$")


def shown(value: Any, limit: int = 60) -> str:
    """A value as an error message shows it: its repr, cut to `limit` characters (a hostile 50 MB string
    is not echoed whole)."""
    text = redact(repr(value))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def out_of_range(value: Any, allowed: str | tuple) -> bool:
    """Whether a coerced value falls outside its key's `allowed` (config/schema.py's `opt`): a tuple of
    words, or a range of finite numbers ("> 0", ">= 0", "[0, 1)", "(0, 1]", ...)."""
    if isinstance(allowed, tuple):
        return any(word not in allowed for word in value) if isinstance(value, list) else value not in allowed
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value) or abs(value) > MAX_INT:
        return True
    if not allowed:
        return False
    lower_op, lower, open_bracket, low, high, close_bracket = RANGE.match(allowed).groups()
    if lower_op:
        return value <= float(lower) if lower_op == ">" else value < float(lower)
    below = value <= float(low) if open_bracket == "(" else value < float(low)
    above = value >= float(high) if close_bracket == ")" else value > float(high)
    return below or above


def describe_allowed(allowed: str | tuple, typ: type) -> str:
    if isinstance(allowed, tuple):
        return "one of " + ", ".join(allowed)
    number = "an integer" if typ is int else "a finite number"
    if not allowed:
        return f"{number} of magnitude <= 2**62" if typ is int else number
    return f"{number} {allowed}" if allowed.startswith(">") else f"{number} in {allowed}"


def _coerce(key: str, value: Any, typ: type, where: str) -> Any:
    """Convert a TOML value or a CLI string to the field's type, or raise a clear error."""
    try:
        if key in AUTO_NUMBERS and value == "auto":
            return AUTO_NUMBERS[key]
        if key in SWITCH_KEYS and (isinstance(value, bool) or str(value).strip().lower() in BOOL_WORDS):
            on = value if isinstance(value, bool) else BOOL_WORDS[str(value).strip().lower()]
            return "true" if on else "false"
        if typ is list:
            return _mixture(value) if key == "data.mixture" else _words(value)
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
    except (ValueError, KeyError, OverflowError):
        expected = (
            typ.__name__
            if typ is not list
            else "[{dir, weight}, ...] (a finite weight > 0) in TOML or DIR:WEIGHT,DIR:WEIGHT"
            if key == "data.mixture"
            else '["a", "b"] in TOML or a,b'
        )
        raise UserError(f"{where}: '{key}' must be {expected}, got {shown(value)}") from None


def _words(value: Any) -> list[str]:
    """A list of words from TOML (["a", "b"]) or the command line ("a,b", or the TOML list itself:
    '["a","b"]', parsed as TOML, never evaluated); "none" alone is the empty list."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = tomllib.loads(f"value = {value}")["value"]  # a TOMLDecodeError is a ValueError
    if isinstance(value, str):
        value = [word.strip() for word in value.split(",") if word.strip()]
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        raise ValueError(value)
    if "none" in value and len(value) > 1:
        raise ValueError(value)  # "none" means no backend, not one more
    return [] if value == ["none"] else list(dict.fromkeys(value))


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
        if not 0 < weight < math.inf:
            raise ValueError(value)
        out.append({"dir": str(item["dir"]), "weight": weight})
    return out


def set_key(cfg: Config, typed_key: str, value: Any, where: str) -> None:
    key, types = canonical_key(typed_key), all_keys(cfg)
    if key == "mlflow.enabled":  # earlier versions' switch: mlflow joins or leaves track.backends
        on, others = _coerce(key, value, bool, where), [b for b in cfg.track.backends if b != "mlflow"]
        cfg.track.backends = ["mlflow", *others] if on else others
        return
    key = RENAMED_KEYS.get(key, key)
    if key not in types:
        raise _unknown_key(typed_key, where)
    section, name = key.split(".", 1)
    target, coerced = getattr(cfg, section), _coerce(key, value, types[key], where)
    if isinstance(coerced, str):  # credentials in a URI stay in this process, never in the config
        coerced = keep_secret(coerced, whole=key in SECRET_KEYS)
    check_value(key, coerced, where)
    setattr(target, name if hasattr(target, name) else name + "_", coerced)


def check_value(key: str, value: Any, where: str) -> None:
    """One line naming the key, the value and what it allows, for a value outside its range (inf, nan,
    1e400, a negative lr, beta2 = 1.5, an unknown word)."""
    allowed = key_allowed()[key]
    if out_of_range(value, allowed):
        raise UserError(
            f"{where}: {key} = {shown(value)} is not allowed: it must be "
            f"{describe_allowed(allowed, all_keys()[key])}"
        )


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


def read_toml(path: Path) -> dict:
    """A TOML file's table, or one line saying why not: not UTF-8 (a UTF-16 file), not TOML, nested
    too deeply to parse (5,000-deep arrays), unreadable."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a UTF-8 byte-order mark is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({shown(str(e), 200)})") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be a config; a config is tables of values") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None


def load_config(path: str | Path | None, overrides: list[str] = (), validated: bool = True) -> Config:
    """A config file (or the defaults) with --section.key=value overrides, checked unless `validated`
    is False (a base that more overrides will complete, see apply_overrides)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: config file not found")
        raw = read_toml(path)
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise _unknown_key(section, str(path))
            for name, value in values.items():
                set_key(cfg, f"{section}.{name}", value, str(path))
    return apply_overrides(cfg, overrides, validated)


def apply_overrides(cfg: Config, overrides: list[str], validated: bool = True) -> Config:
    """cfg (changed in place, and returned) with --section.key=value overrides applied, then checked.
    A horizon given on the command line replaces the config's (a run has one: HORIZON_KEYS)."""
    parsed = parse_overrides(list(overrides))
    if any(canonical_key(key) in HORIZON_KEYS for key, _ in parsed):
        t = cfg.train
        t.max_steps, t.max_tokens, t.tokens_per_param, t.epochs = 0, 0, 0.0, 0.0
    for key, value in parsed:
        set_key(cfg, key, value, "command line")
    if validated:
        validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    m, t, o = cfg.model, cfg.train, cfg.optim
    checks = [
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
        (
            cfg.run.requeue_signals in ("auto", "none") or stop_signal_names(cfg.run.requeue_signals),
            f'run.requeue_signals = "{cfg.run.requeue_signals}": use "auto", "none", or signal names among '
            f'{", ".join(name[3:] for name in STOP_SIGNAL_NAMES)}, e.g. "USR1,TERM"',
        ),
        (
            not (cfg.model.dropout and cfg.data.packing == "document"),
            "model.dropout with data.packing = document: the document-masked attention kernel (flex "
            "attention) has no dropout; use model.dropout = 0 or data.packing = concat",
        ),
        (
            cfg.ckpt.every != -1 or cfg.ckpt.interruptions_per_hour > 0,
            "ckpt.every = auto needs ckpt.interruptions_per_hour > 0 (the rate its interval is chosen for; "
            "on a reliable machine set ckpt.every to a number of steps)",
        ),
        (
            t.micro_batch > 0 or t.global_batch > 0,
            "train.micro_batch = auto needs train.global_batch (the batch it keeps)",
        ),
        # FSDP2 shards the moments already; gathering and re-sharding quantised ones for checkpoints is not
        # tested here
        (
            OPTIMIZERS[o.name].fsdp or cfg.parallel.strategy == "ddp",
            f"optim.name = {o.name} needs parallel.strategy = ddp "
            "(also for one process); with fsdp use optim.name = adamw",
        ),
        (
            not cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour > 0,
            "budget.cap_usd needs budget.usd_per_gpu_hour (the estimate, and the fallback when budget.json "
            "is missing or stale)",
        ),
        (0 < cfg.spike.min_values <= cfg.spike.window, "spike.min_values must be in [1, spike.window]"),
        (
            cfg.spike.max_consecutive == 0 or cfg.spike.max_consecutive >= 2,
            "spike.max_consecutive must be 0 (off) or >= 2",
        ),
        (not (cfg.data.dir and cfg.data.mixture), "set data.dir or data.mixture, not both"),
        (len(cfg.data.mixture) != 1, "data.mixture needs two or more sources (one source: data.dir)"),
    ]
    for key, value in flatten(cfg).items():  # set in code (resolve) as well as read: every value in range
        check_value(key, value, "config")
    for ok, message in checks:
        if not ok:
            raise UserError(f"config: {message}")


def from_dict(raw: dict[str, dict[str, Any]], where: str) -> Config:
    """A saved config (a checkpoint's state.json, a run's config.toml) as the config it ran with."""
    cfg = Config()
    for section, values in raw.items():
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value, where)
    return earlier_defaults(cfg, raw)


def load_saved_config(path: Path) -> Config:
    """A run's saved config.toml, not yet checked (overrides may complete it), as its run trained."""
    return earlier_defaults(load_config(path, validated=False), read_toml(path))


def earlier_defaults(cfg: Config, raw: dict[str, dict[str, Any]]) -> Config:
    """A saved config lacks the keys added after it was written: each takes the value its run trained
    with (EARLIER_DEFAULTS), not today's default (an older llama had no QK-norm)."""
    for key, value in EARLIER_DEFAULTS.items():
        section, name = key.split(".")
        if name not in (raw.get(section) or {}):
            setattr(getattr(cfg, section), name, value)
    return cfg
