"""The config explained to people: the resolved TOML with each key's help as a comment
(`pretrainer config`) and the key reference of `pretrainer train --help`. The help itself lives in
one place, the dataclass field metadata of pretrainer.config.
"""

from __future__ import annotations

from typing import Any

from pretrainer.config.keys import AUTO_NUMBERS, all_keys, flatten, key_allowed, key_help, to_dict
from pretrainer.config.schema import Config
from pretrainer.config.toml_text import toml_value as toml_literal


def toml_value(key: str, value: Any) -> str:
    """One key's value as TOML writes it (config/toml_text's quoting and number format); "auto" for the number
    that means auto (train.micro_batch = 0, optim.lr = 0, ...), as a config may write it."""
    if key in AUTO_NUMBERS and value == AUTO_NUMBERS[key]:
        value = "auto"
    return toml_literal(value)


def config_text_with_help(cfg: Config) -> str:
    """The config as TOML with each key's help as a comment above it (and its default when it differs)."""
    lines, defaults, helps = [], flatten(Config()), key_help()
    for section, values in to_dict(cfg).items():
        lines += ["", f"[{section}]"]
        for name, value in values.items():
            key = f"{section}.{name}"
            default = f" (default {toml_value(key, defaults[key])})" if value != defaults[key] else ""
            lines += [f"# {helps[key]}{default}", f"{name} = {toml_value(key, value)}"]
    return "\n".join(lines).lstrip("\n") + "\n"


def type_and_range(key: str) -> str:
    """A key's type with the numbers it allows: "float > 0", "int in [0, 4294967295]", "str"."""
    name, allowed = all_keys()[key].__name__, key_allowed()[key]
    if not allowed or isinstance(allowed, tuple):
        return name
    return f"{name} {allowed}" if allowed.startswith(">") else f"{name} in {allowed}"


def keys_reference(width: int = 100) -> str:
    """Every key with its type, default and help, grouped by section: the `train --help` epilog."""
    import textwrap

    lines, helps = [], key_help()
    for section, values in to_dict(Config()).items():
        lines.append(f"[{section}]")
        for name, default in values.items():
            key = f"{section}.{name}"
            lines.append(f"  --{key}  ({type_and_range(key)}, default {toml_value(key, default)})")
            lines += textwrap.wrap(helps[key], width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
