"""Which config `pretrainer train` runs: a config file with overrides, or, without one, a run's saved
config (RUN_DIR/config.toml) or a checkpoint's (its state.json), so a run continues with nothing
retyped."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pretrainer.config.keys import NEVER_INHERITED, flatten
from pretrainer.config.load import apply_overrides, from_dict, load_config, load_saved_config
from pretrainer.config.resolve import horizon_keys_set
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError
from pretrainer.core.secrets import lost_secret


def load_train_config(path: str | Path | None, overrides: list[str]) -> Config:
    """The config `pretrainer train` runs: the config file (or the defaults) with the overrides. With
    no config file, a run is continued with its saved config, so nothing is retyped:
    `--train.resume=CHECKPOINT` takes that checkpoint's config, else a run.dir holding config.toml
    takes that one. (Given a config file anyway, the trainer compares it with the checkpoint's and
    reports the changes.) The keys of one launch (stop_at_step, resume) are not inherited."""
    given = load_config(path, overrides, validated=path is not None)  # checked once complete
    resume, run_dir = given.train.resume, Path(os.path.expanduser(given.run.dir))
    if path is not None:
        return given
    if resume not in ("auto", "never"):
        cfg, source = read_trainer_config(Path(os.path.expanduser(resume))), resume
    elif (run_dir / "config.toml").is_file():
        saved = run_dir / "config.toml"
        cfg, source = load_saved_config(saved), str(saved)
    else:
        return apply_overrides(given, [])
    if os.environ.get("RANK", "0") == "0":  # the launcher (or the only process) says it once
        print(f"note: continuing with the saved config {source}")
    cfg.train.stop_at_step, cfg.train.resume = Config().train.stop_at_step, Config().train.resume
    cfg.run.dir = str(run_dir)  # where it is now, if the run dir was moved
    if horizon_keys_set(cfg.train):
        cfg.train.max_steps = 0  # derived again from the run's horizon: the world size may differ
    dropped = drop_uninheritable(cfg)
    cfg = apply_overrides(cfg, overrides)
    dropped = [key for key in dropped if not flatten(cfg)[key]]  # not given again by this launch
    if dropped and os.environ.get("RANK", "0") == "0":
        print(
            f"note: not inherited from {source}: {', '.join(dropped)} (shell commands and credentials come "
            f"only from this launch's command line or config file); pass them again to use them"
        )
    hub = cfg.data.dir.startswith("hf://")  # pulled again (or found in the hub cache) at launch
    if not hub and not Path(cfg.data.dir).is_absolute() and not Path(cfg.data.dir).is_dir():
        raise UserError(
            f"{source}: data.dir = {cfg.data.dir} is relative (saved by an older version) and not found "
            f"from here; pass --data.dir=DIR"
        )
    return cfg


def drop_uninheritable(cfg: Config) -> list[str]:
    """A saved config (a run's config.toml, another run's checkpoint) never brings a shell command
    (run.on_exit) or a URL whose credentials were masked when it was saved: each goes back to its
    default. -> the dotted keys dropped."""
    dropped = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for field in dataclasses.fields(values):
            key, value = f"{section.name}.{field.name.rstrip('_')}", getattr(values, field.name)
            if isinstance(value, str) and value and (key in NEVER_INHERITED or lost_secret(value)):
                setattr(values, field.name, getattr(type(values)(), field.name))
                dropped.append(key)
    return dropped


def read_trainer_config(checkpoint: Path) -> Config:
    """The (resolved) config a checkpoint was trained with, from its state.json."""
    from pretrainer.artifacts.checkpoint import read_trainer_state  # torch: only for this case

    return from_dict(read_trainer_state(checkpoint)["config"], f"{checkpoint}/state.json")
