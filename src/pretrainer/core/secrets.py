"""Credentials never reach a file: a URI's password (`http://user:PASSWORD@host`) and secret query
values (`?token=...`) are replaced by `***` wherever a value is kept (config, state.json, manifests,
reports, logs, tracker params), as soon as the config is read. The real value stays in this process
only, for the one place that connects with it (`reveal`).

    redact("http://ann:pw@host/?token=t&x=1")  # -> "http://ann:***@host/?token=***&x=1"
"""

from __future__ import annotations

import re

MASK = "***"
# the password runs to the last "@" before the host (a raw "@" in it is still the password's)
USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/?#@\s]*):(?P<secret>[^/?#\s]+)@")
# a token given as the user name alone (https://TOKEN@host): long, unlike a login name
TOKEN_USER = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<secret>[^:/?#@\s]{20,})@")
SECRET_QUERY = re.compile(
    r"(?P<name>[?&;](?:[\w.-]*(?:token|key|secret|password|passwd|pwd|sig|signature|auth|credential)[\w.-]*))"
    r"=(?P<secret>[^&;#\s]+)",
    re.IGNORECASE,
)

_revealed: dict[str, str] = {}  # redacted value -> the value it came from, in this process only


def redact(text: str) -> str:
    """`text` with every URI password and secret query value replaced by ***."""
    text = USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = TOKEN_USER.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return SECRET_QUERY.sub(lambda m: f"{m['name']}={MASK}" if m["secret"] != MASK else m[0], text)


def keep_secret(value: str, whole: bool = False) -> str:
    """-> `value` redacted, remembering the original for `reveal` (a config value, as it is read). Only
    a URI is touched: a path stays as it is. `whole`: a URI that is itself the credential (a Slack or
    Discord webhook): only its scheme and host are kept."""
    if whole and value and not value.endswith(f"/{MASK}") and value != MASK:
        scheme, rest = value.split("://", 1) if "://" in value else ("", value)
        host = re.split(r"[/?#]", rest, maxsplit=1)[0].rsplit("@", 1)[-1]
        redacted = f"{scheme}://{host}/{MASK}" if scheme else MASK
        _revealed[redacted] = value
        return redacted
    if "://" not in value:
        return value
    redacted = redact(value)
    if redacted != value:
        _revealed[redacted] = value
    return redacted


def reveal(value: str) -> str:
    """The value a redacted one came from in this process (to connect with), else `value` itself."""
    return _revealed.get(value, value)


def lost_secret(value: str) -> bool:
    """A redacted value whose original this process does not have: read back from a saved config, so
    what it names cannot be reached with it (pass the option again)."""
    return value not in _revealed and (value == MASK or any(f"{c}{MASK}" in value for c in (":", "=", "/")))


def forget_secrets() -> None:
    """A new command starts with none (the CLI's entry: each invocation brings its own)."""
    _revealed.clear()
