"""A config as TOML text: what RUN_DIR/config.toml and `pretrainer config` hold.

A config is two levels deep: sections of scalars, lists of scalars and lists of small tables
(data.mixture). This writes exactly those, laid out as tomli-w lays them out (byte for byte on every
shipped config: tests/unit/config/test_toml_text.py), and tomllib reads them back. Written here rather
than imported because it is the one thing every verb needed at import: with it, `pretrainer` runs on a
site's own PyTorch with nothing brought in (an air-gapped GPU node), and reading needs only tomllib.
"""

from __future__ import annotations

import re
from typing import Any

# TOML's short escapes; any other control character is written as \\uXXXX
ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
INDENT = "    "


def toml_string(text: str) -> str:
    """A TOML basic string (double quotes, escapes), valid for any Python str."""
    out = []
    for char in text:
        if char in ESCAPES:
            out.append(ESCAPES[char])
        elif ord(char) < 0x20 or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """One value as TOML writes it: bool, int, float (inf and nan included), str, a list of these or of
    tables (one item per line), a table inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)  # Python's float repr is valid TOML: 1e-05, 1e+16, inf, -inf, nan
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, dict):
        items = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {items} }}" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[\n" + "".join(f"{INDENT}{toml_value(v)},\n" for v in value) + "]" if value else "[]"
    raise TypeError(f"a config value of type {type(value).__name__} has no TOML form: {value!r}")


def toml_document(sections: dict[str, dict[str, Any]]) -> str:
    """Sections of key = value lines, a blank line between sections."""
    return "\n".join(
        "".join([f"[{toml_key(name)}]\n", *(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in values.items())])
        for name, values in sections.items()
    )
