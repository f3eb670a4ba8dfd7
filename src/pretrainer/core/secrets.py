"""Credentials never reach a file: a URI's password (`http://user:PASSWORD@host`), a user part with no
password (`https://TOKEN@host`: a token, as often as a name), secret query values (`?token=...`) and a
fragment (`#TOKEN`) are replaced by `***` wherever a value is kept (config, state.json, manifests,
reports, logs, tracker params), as soon as the config is read. The real value stays in this process
only, for the one place that connects with it (`reveal`).

    redact("http://ann:pw@host/?token=t&x=1")  # -> "http://ann:***@host/?token=***&x=1"
"""

from __future__ import annotations

import re

MASK = "***"
# the password runs to the last "@" before the host (a raw "@" in it is still the password's)
USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/?#@\s]*):(?P<secret>[^/?#\s]+)@")
# a user part with no password (https://TOKEN@host): a token as often as a login name, of any length
TOKEN_USER = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<secret>[^:/?#@\s]+)@")
# a URI's fragment (https://host/x#TOKEN): never sent to a server, so a place to carry a token
FRAGMENT = re.compile(r"(?P<uri>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s#]*)#(?P<secret>\S+)")
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
    text = FRAGMENT.sub(lambda m: f"{m['uri']}#{MASK}", text)
    return SECRET_QUERY.sub(lambda m: f"{m['name']}={MASK}" if m["secret"] != MASK else m[0], text)


def keep_secret(value: str, whole: bool = False) -> str:
    """-> `value` redacted, remembering the original for `reveal` (a config value, as it is read). Only
    a URI is touched: a path stays as it is. `whole`: a URI that is itself the credential (a Slack or
    Discord webhook): only its scheme and host are kept; anything else (a shell command) is masked whole."""
    if whole and value and not value.endswith(f"/{MASK}") and value != MASK:
        uri = re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S*", value)  # else a shell command: all of it
        scheme, rest = value.split("://", 1) if uri else ("", value)
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
    masked = any(f"{c}{MASK}" in value for c in (":", "=", "/", "#"))
    return value not in _revealed and (value == MASK or masked)


def forget_secrets() -> None:
    """A new command starts with none (the CLI's entry: each invocation brings its own)."""
    _revealed.clear()
