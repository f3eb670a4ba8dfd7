"""Tokenizers: GPT-2 BPE through tiktoken, or a byte-level BPE trained on the corpus with rustbpe
(this module), or any Hugging Face tokenizer.json (`hf:DIR_OR_REPO`, data/tokenizers/hf.py, the same
interface; `load.load_tokenizer` opens a directory saved by either).

Both are tiktoken `Encoding`s in the end, so encoding is fast and identical everywhere. A tokenizer
is saved next to the data it produced (and copied into each run dir) as:

    pretrainer-tokenizer.json  {"name", "pattern", "special_tokens", "vocab_size", "sha256"}
    tokenizer.tiktoken         the merge ranks, one "base64(token) rank" line each (tiktoken's format)
    tokenizer.json,            the same tokenizer for Hugging Face (`AutoTokenizer.from_pretrained(DIR)`):
    tokenizer_config.json      a `tokenizers` byte-level BPE that encodes exactly like ours; not read back

`sha256` covers the ranks, the split pattern and the special tokens, so any change is caught.
Directories written before the Hugging Face files existed hold our metadata in tokenizer.json;
`load_tokenizer` still reads them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken

from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes, sha256_file
from pretrainer.data.tokenizers.base import (
    EOT,
    METADATA_FILE,
    RANKS_FILE,
    TOKENIZER_FILES,
    _bytes_to_unicode,
    cache_dir,
)

# GPT-2's pre-tokenisation regex, written here rather than taken from tiktoken (whose r50k text has
# changed between releases without changing what it matches): the tokenizer's sha256 covers the
# pattern text, so it must not depend on the installed tiktoken.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The GPT-4 style split pattern (digits in groups of up to 3, whitespace runs kept together),
# better than GPT-2's for code, where indentation is most of the bytes.
BPE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# Offline GPT-2 ranks: `make setup` (`pretrainer fetch-gpt2`) takes them from the openai-whisper
# sdist on PyPI, which ships tiktoken's gpt2 ranks file, and checks this hash.
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_RANKS_SOURCE = ("openai-whisper==20250625", "whisper/assets/gpt2.tiktoken")
GPT2_VOCAB_SIZE = 50257


def gpt2_ranks_path() -> Path:
    return Path(os.environ.get("PRETRAINER_GPT2_RANKS", cache_dir() / "gpt2.tiktoken"))


def _serialise_ranks(ranks: dict[bytes, int]) -> bytes:
    lines = (
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )
    return b"\n".join(lines) + b"\n"


def _parse_ranks(data: bytes, where: str) -> dict[bytes, int]:
    ranks = {}
    try:
        for line in data.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except ValueError:
        raise UserError(f"{where}: not a tiktoken ranks file (expected 'base64 rank' lines)") from None
    return ranks


class Tokenizer:
    """A tiktoken encoding plus the facts the rest of the package needs (name, EOT id, hash)."""

    kind = "tiktoken"
    files = TOKENIZER_FILES
    eot_name = EOT
    bos_name, bos_id = None, None  # documents are separated by end-of-text alone, as in GPT-2

    def __init__(self, name: str, pattern: str, ranks: dict[bytes, int], extra_special: tuple[str, ...] = ()):
        self.name = name
        self.pattern = pattern
        self.ranks = ranks
        self.eot_id = len(ranks)  # the end-of-text token follows the merges, as in GPT-2 (50256)
        # more special tokens (the chat format's, data/tokenizers/chat_format.py) are appended after it, so
        # every id a base model knows keeps its meaning and the model's vocabulary only grows
        self.special_tokens = {
            EOT: self.eot_id,
            **{name: self.eot_id + 1 + i for i, name in enumerate(extra_special)},
        }
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.sha256 = hashlib.sha256(
            _serialise_ranks(ranks)
            + pattern.encode()
            + json.dumps(self.special_tokens, sort_keys=True).encode()
        ).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def extra_special(self) -> tuple[str, ...]:
        """The special tokens after end-of-text, in id order."""
        return tuple(
            name for name, _ in sorted(self.special_tokens.items(), key=lambda kv: kv[1]) if name != EOT
        )

    def with_special(self, names: tuple[str, ...]) -> "Tokenizer":
        """This tokenizer with `names` appended as special tokens
        (those it already has are kept, in place)."""
        return Tokenizer(
            self.name,
            self.pattern,
            self.ranks,
            self.extra_special + tuple(n for n in names if n not in self.special_tokens),
        )

    def extends(self, base: "Tokenizer") -> bool:
        """Whether every id of `base` means the same here: the same merges and pattern, and base's
        special tokens with the same ids (more may follow)."""
        return (
            isinstance(base, Tokenizer)
            and self.pattern == base.pattern
            and self.ranks == base.ranks
            and all(self.special_tokens.get(name) == i for name, i in base.special_tokens.items())
        )

    def special_id(self, name: str) -> int:
        if name not in self.special_tokens:
            raise UserError(
                f"tokenizer {self.name} has no special token {name}; prepare the data with --format chat"
            )
        return self.special_tokens[name]

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 bytes each token id stands for (0 for special tokens such as the document separator),
        so the bytes of any span of ids, cut anywhere, are the sum over its ids: bits per byte."""
        lengths = [0] * self.vocab_size
        for token, rank in self.ranks.items():
            lengths[rank] = len(token)
        return lengths

    def encode(self, text: str) -> list[int]:
        # Ordinary encoding: a literal "<|endoftext|>" inside a document is text, not a boundary.
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / RANKS_FILE, _serialise_ranks(self.ranks))
        meta = {
            "name": self.name,
            "pattern": self.pattern,
            "special_tokens": self.special_tokens,
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
        }
        # ours before Hugging Face's tokenizer.json, which replaces an older version's metadata file
        # of that name
        atomic_write_bytes(directory / METADATA_FILE, (json.dumps(meta, indent=2) + "\n").encode())
        hf_tokenizer_files(self, directory)

    def is_saved_in(self, directory: Path) -> bool:
        """Whether `directory` already holds this tokenizer, ours and Hugging Face's files (building the
        latter takes seconds for GPT-2's 50K merges: a resumed run need not redo it)."""
        directory = Path(directory)
        try:
            saved = json.loads((directory / METADATA_FILE).read_text())["sha256"]
        except (OSError, ValueError, KeyError):
            return False
        return saved == self.sha256 and all((directory / name).is_file() for name in TOKENIZER_FILES)

    @classmethod
    def from_saved(cls, directory: Path, meta: dict, meta_path: Path) -> Tokenizer:
        """The tokenizer in `directory` from its parsed metadata (load.load_tokenizer reads it)."""
        ranks_path = Path(directory) / RANKS_FILE
        if not ranks_path.is_file():
            raise UserError(
                f"{ranks_path}: tokenizer file missing; re-run `pretrainer prepare` for this data"
            )
        try:
            extra = tuple(
                name
                for name, _ in sorted(meta["special_tokens"].items(), key=lambda kv: kv[1])
                if name != EOT
            )
            tok = cls(
                meta["name"], meta["pattern"], _parse_ranks(ranks_path.read_bytes(), str(ranks_path)), extra
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(
                f"{meta_path}: malformed tokenizer metadata ({e}); re-run `pretrainer prepare`"
            ) from None
        if tok.sha256 != meta["sha256"] or tok.special_tokens != meta["special_tokens"]:
            raise UserError(
                f"{ranks_path}: does not match the sha256 in {meta_path.name}; "
                f"the tokenizer files were changed"
            )
        return tok


def _split_into_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge creates `token`: byte-pair encode it using only lower-ranked merges."""
    parts = [bytes([b]) for b in token]
    limit, rank = ranks[token], ranks.get
    # the rank of each adjacent pair's merge, updated around each merge (not recomputed: GPT-2's 50K
    # tokens took seconds); the lowest merges first, the leftmost among equals
    pairs = [rank(a + b, limit) for a, b in zip(parts, parts[1:])]
    while len(parts) > 2:
        lowest = min(pairs)
        if lowest >= limit:
            break
        best = pairs.index(lowest)
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
        del pairs[best]
        if best > 0:
            pairs[best - 1] = rank(parts[best - 1] + parts[best], limit)
        if best < len(pairs):
            pairs[best] = rank(parts[best] + parts[best + 1], limit)
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not reachable by one merge")
    return parts[0], parts[1]


def hf_tokenizer_files(tokenizer: Tokenizer, out: Path, model_max_length: int | None = None) -> None:
    """Write tokenizer.json + tokenizer_config.json that encode exactly like our tiktoken encoding (an
    hf: tokenizer writes its own tokenizer.json unchanged, HFTokenizer.write_hf_files).
    model_max_length: the model's context (None: unknown, as for a data dir;
    transformers then sets no limit)."""
    if tokenizer.kind == "hf":
        return tokenizer.write_hf_files(out, model_max_length)
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    byte_map = _bytes_to_unicode()
    as_text = lambda b: "".join(byte_map[x] for x in b)  # noqa: E731
    by_rank = sorted(tokenizer.ranks.items(), key=lambda kv: kv[1])
    vocab = {as_text(token): rank for token, rank in by_rank}
    merges = [
        tuple(map(as_text, _split_into_merge(token, tokenizer.ranks)))
        for token, _ in by_rank
        if len(token) > 1
    ]
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    names = [EOT, *tokenizer.extra_special]  # in id order, so each gets its id
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    for name in names:
        if hf.token_to_id(name) != tokenizer.special_tokens[name]:
            raise AssertionError(
                f"special token {name}: id {hf.token_to_id(name)} != {tokenizer.special_tokens[name]}"
            )
    atomic_write_bytes(out / "tokenizer.json", hf.to_str(pretty=True).encode())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    if tokenizer.extra_special:  # a chat tokenizer: its template for transformers' apply_chat_template
        from pretrainer.data.tokenizers.chat_format import (
            ASSISTANT_END,
            BOS,
            HF_CHAT_TEMPLATE,
            is_chat_tokenizer,
        )

        if is_chat_tokenizer(tokenizer):
            config.update(bos_token=BOS, eos_token=ASSISTANT_END, chat_template=HF_CHAT_TEMPLATE)
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    atomic_write_bytes(out / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with rustbpe: 256 byte tokens + merges + one end-of-text token."""
    import rustbpe

    if vocab_size < 257 or vocab_size > 2**32:
        raise UserError(
            f"--tokenizer bpe:{vocab_size}: vocab size must be at least 257 (256 bytes + end-of-text)"
        )
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(texts, vocab_size - 1, pattern=BPE_PATTERN)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    if len(ranks) != vocab_size - 1:
        raise UserError(
            f"--tokenizer bpe:{vocab_size}: the corpus only supports {len(ranks) + 1} tokens; "
            f"use a smaller vocab"
        )
    return Tokenizer(f"bpe:{vocab_size}", BPE_PATTERN, ranks)


def load_gpt2() -> Tokenizer:
    """GPT-2 BPE: from the local ranks file if present (offline), else tiktoken's download."""
    path = gpt2_ranks_path()
    if path.is_file():
        if sha256_file(path) != GPT2_RANKS_SHA256:
            raise UserError(
                f"{path}: sha256 does not match the GPT-2 ranks; delete it and run `pretrainer fetch-gpt2`"
            )
        return Tokenizer("gpt2", GPT2_PATTERN, _parse_ranks(path.read_bytes(), str(path)))
    try:
        online = tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline: requests raises a connection error deep inside tiktoken
        raise UserError(
            f"{path}: GPT-2 ranks not found and download failed ({type(e).__name__}); "
            f"run `make setup` or `pretrainer fetch-gpt2`"
        ) from None
    return Tokenizer("gpt2", GPT2_PATTERN, online._mergeable_ranks)


def fetch_gpt2_ranks(dest: Path | None = None) -> Path:
    """Download the openai-whisper sdist with pip, extract gpt2.tiktoken, verify its sha256."""
    dest = Path(dest or gpt2_ranks_path())
    if dest.is_file() and sha256_file(dest) == GPT2_RANKS_SHA256:
        return dest
    requirement, member_suffix = GPT2_RANKS_SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            tmp,
            requirement,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise UserError(
                f"pip could not download {requirement} for the GPT-2 ranks: "
                f"{result.stderr.strip().splitlines()[-1:]}"
            )
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith(member_suffix)]
            if not members:
                raise UserError(f"{sdists[0].name}: has no {member_suffix}")
            data = tar.extractfile(members[0]).read()
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise UserError(f"{requirement}: {member_suffix} has an unexpected sha256; refusing to use it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dest, data)
    return dest
