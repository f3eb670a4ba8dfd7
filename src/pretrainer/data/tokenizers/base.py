"""What every tokenizer shares: the end-of-text token, the file names of a saved tokenizer, the
cache directory, GPT-2's byte-to-unicode map, and the interface (`Tokenizer`) that the BPE
(bpe.py), Hugging Face (hf.py) and chat-format (chat_format.py) modules build on."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

EOT = "<|endoftext|>"

METADATA_FILE = "pretrainer-tokenizer.json"
LEGACY_METADATA_FILE = "tokenizer.json"  # ours until Hugging Face's tokenizer.json took the name
RANKS_FILE = "tokenizer.tiktoken"
HF_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_FILES = (METADATA_FILE, RANKS_FILE, *HF_FILES)


def cache_dir() -> Path:
    return Path(os.environ.get("PRETRAINER_CACHE", Path.home() / ".cache" / "pretrainer"))


def metadata_path(directory: Path) -> Path:
    """Our metadata file in a tokenizer directory: pretrainer-tokenizer.json, or tokenizer.json in a
    directory written before the Hugging Face files took that name."""
    current = Path(directory) / METADATA_FILE
    legacy = Path(directory) / LEGACY_METADATA_FILE
    return legacy if not current.is_file() and legacy.is_file() else current


# --- the Hugging Face form (tokenizer.json for `tokenizers` / `transformers`) ---


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (used by byte-level BPE files)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


class Tokenizer(Protocol):
    """The interface every tokenizer kind has (bpe.Tokenizer, hf.HFTokenizer)."""

    name: str
    kind: str
    sha256: str
    eot_id: int
    special_tokens: dict[str, int]

    @property
    def vocab_size(self) -> int: ...

    @property
    def extra_special(self) -> tuple[str, ...]: ...

    def with_special(self, names: tuple[str, ...]) -> Tokenizer: ...

    def special_id(self, name: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...
