"""The config's keys as keys: the tables that say how a key behaves beyond its type (free to change on
resume, renamed since, a switch word, "auto", a secret, a horizon), and the config's flat and saved forms
(every key's type, help and allowed values; the dict, flat view, hash, diffs, TOML text and file). The
sections themselves, with each key's help, are `pretrainer.config.schema`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from pretrainer.config.schema import AlertsConfig, Config, TrackConfig
from pretrainer.config.toml_text import toml_document

# budget keys only plan reads (its cost lines and go/no-go)
PLAN_ONLY_BUDGET_KEYS = (
    "gpu",
    "disk_gb",
    "disk_usd_per_gb_month",
    "data_prep_hours",
    "egress_usd",
    "restarts",
    "max_usd_per_gpu_hour",
)
# Keys that may differ between a run and its resumption without changing what is computed.
# run.dir: a run may be moved; data.verify: how hard a launch checks the data, not what it computes
# run.*/alerts.*/max_hours/keep_best: what happens around the computation, not the computation
RESUME_FREE_KEYS = (
    "train.stop_at_step",
    "train.resume",
    "run.dir",
    "data.verify",
    "data.prefetch",
    "train.threads",  # on CPU the sums split differently: the resume says it is close, not bit-exact
    "run.requeue_signals",
    "run.stop_margin_s",
    "run.on_exit",
    "run.on_exit_timeout_s",
    "train.max_hours",
    "ckpt.keep_best",
    "ckpt.every",
    "ckpt.interruptions_per_hour",
    *(f"budget.{name}" for name in PLAN_ONLY_BUDGET_KEYS),
    *(f"alerts.{f.name}" for f in dataclasses.fields(AlertsConfig)),
    *(f"track.{f.name}" for f in dataclasses.fields(TrackConfig)),  # where numbers go, not what they are
)
# keys of earlier versions, read (a saved run's config.toml, an old config) as the keys that replaced them
RENAMED_KEYS = {"mlflow.uri": "track.mlflow_uri", "mlflow.experiment": "track.experiment"}
# words that also read as booleans: true/false/yes/no/on/off/1/0 and a bare --flag give "true"/"false"
SWITCH_KEYS = ("train.compile", "model.qkv_bias", "model.qk_norm")
# keys added since a config could be saved without them, and the value a run saved then trained with (a saved
# config lacking one is read with that value, not today's default: config/load.earlier_defaults)
EARLIER_DEFAULTS = {"model.qk_norm": "false", "optim.embedding_lr_scale": 1.0}
# numbers a config may write as "auto", and the number that means it
AUTO_NUMBERS = {
    "train.micro_batch": 0,
    "ckpt.every": -1,
    "optim.lr": 0,
    "optim.warmup_steps": -1,
    "optim.embedding_lr_scale": 0,
}
# values that are credentials as a whole: only their scheme and host are ever kept (core/secrets.py)
# masked whole in every file a run writes (config.toml, state.json, trackers, reports, exports, cards)
SECRET_KEYS = ("alerts.webhook_url", "run.on_exit")
# never taken from a saved config: a shell command runs only if this launch was given it
NEVER_INHERITED = ("run.on_exit",)
# the run's horizon: exactly one is set; resolve() derives train.max_steps from any of the others
HORIZON_KEYS = ("train.max_steps", "train.max_tokens", "train.tokens_per_param", "train.epochs")


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


def key_allowed() -> dict[str, str | tuple]:
    """Every dotted key with the values it allows ("" = any of its type), e.g. {"optim.lr": "> 0", ...}."""
    return {key: f.metadata["allowed"] for key, f, _ in _fields(Config())}


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every section's keys and values, a secret key's value redacted (a config built in Python was not
    read through config/load.py, which redacts as it reads)."""
    from pretrainer.core.secrets import keep_secret

    out = {
        section: {_key_name(k): v for k, v in values.items()}
        for section, values in dataclasses.asdict(cfg).items()
    }
    for key in SECRET_KEYS:
        section, name = key.split(".")
        if out[section][name]:
            out[section][name] = keep_secret(out[section][name], whole=True)
    return out


def flatten(cfg: Config) -> dict[str, Any]:
    """{"optim.lr": 3e-4, ...}: the one flat view, used for the hash, diffs and the trackers' params."""
    return {
        f"{section}.{key}": value for section, values in to_dict(cfg).items() for key, value in values.items()
    }


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config, leaving out the keys that only say when to stop or resume."""
    flat = {k: v for k, v in flatten(cfg).items() if k not in RESUME_FREE_KEYS}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def diff_keys(a: Config, b: Config) -> list[str]:
    fa, fb = flatten(a), flatten(b)
    return [k for k in fa if fa[k] != fb[k] and k not in RESUME_FREE_KEYS]


def config_text(cfg: Config) -> str:
    """The config as TOML: what RUN_DIR/config.toml holds."""
    return toml_document(to_dict(cfg))


def save_config(cfg: Config, path: Path) -> None:
    from pretrainer.core.files import atomic_write_bytes

    atomic_write_bytes(path, config_text(cfg).encode())
