"""Any Hugging Face tokenizer: `--tokenizer hf:DIR_OR_REPO` reads a `tokenizer.json` with the
`tokenizers` library and uses it unchanged.

DIR_OR_REPO is a local directory holding tokenizer.json (or the file itself), else a hub repo id
(`hf:meta-llama/Llama-3.2-1B`) whose tokenizer.json `huggingface_hub` downloads, or reads from the
local hub cache when offline (HF_HUB_OFFLINE=1). `HFTokenizer` has the interface of the tiktoken
`Tokenizer` (data/tokenizers/bpe.py) that the rest of the package uses. Saved (data dir, RUN/tokenizer) as

    tokenizer.json             the source file, byte for byte
    pretrainer-tokenizer.json  {"kind": "hf", "name", "source", "file_sha256", "eot_token", "eot_id",
                                "bos_token", "bos_id", "extra_special", "special_tokens", "vocab_size",
                                "sha256"}

`sha256` (the tokenizer's identity in manifests and run records) covers the file's sha256, the
chosen end-of-text and BOS and the special tokens pretrainer uses, so data made with another
--eot-token is another tokenizer.

Documents. Each document is `[BOS] ids EOT`: the ids are the tokenizer's encoding with
add_special_tokens=False (no post-processor tokens inside the stream) and special tokens written in
a document's text encoded as text (`encode_special_tokens`, as tiktoken's encode_ordinary does for
our own tokenizers). EOT, the document separator, is --eot-token, else the first special token named
<|endoftext|>, <|end_of_text|>, </s>, <eos> or <|eos|>, else the token the post-processor appends,
else tokenizer_config.json's eos_token; none of these is an error. BOS is the one token the
tokenizer's post-processor puts before a sequence (Llama-3's <|begin_of_text|>, Mistral's <s>), when
there is one and it is not EOT: every document then starts with it, as `tokenizer(text)` does in
`transformers`, so an exported model and its unchanged tokenizer agree. Tokenizers without one
(GPT-2's, SmolLM's, ours) get EOT-separated documents as before.

Chat tokens (data/tokenizers/chat_format.py) the file lacks are appended as special tokens after its
vocabulary; they are listed in the metadata (the saved tokenizer.json stays the source file) and
written into an exported tokenizer.json.

Bits per byte (`token_byte_lengths`): a byte-level BPE piece counts the bytes it maps to through
GPT-2's byte<->unicode table, a byte-fallback piece <0xNN> one byte, a sentencepiece piece its text
with "▁" as one space (a document's first word, whose "▁" the decoder drops, counts one byte too
many), a WordPiece piece its text without the "##" prefix, a non-special added token its UTF-8
text, and special tokens (EOT, BOS, chat tokens) 0.

A .txt file streamed in pieces (data/sources.Piece) is cut where every byte-level split pattern
breaks; a sentencepiece-style tokenizer (Metaspace) may encode a cut line start as "▁word" where the
whole file gives "word": a few ids differ in files over 64 MiB.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes
from pretrainer.data.tokenizers.base import METADATA_FILE, _bytes_to_unicode

HF_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# end-of-text candidates, in order, among the file's special tokens
# (<|im_end|> ends a chat turn, not a document)
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def _parse(data: bytes, where: str):
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for invalid JSON or an unknown layout
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{where}: not a valid Hugging Face tokenizer.json ({reason}); give the tokenizer.json "
            f"`tokenizers` writes (tokenizer.save(PATH)) or a model directory holding one"
        ) from None
    # a file saved with truncation or padding on (sentence-transformers exports often are) would cut or pad
    # every document: off here, and the file itself stays unchanged
    backend.no_truncation()
    backend.no_padding()
    return backend


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit]) + (f", ... {len(names) - limit} more" if len(names) > limit else "")
    return shown or "none"


class HFTokenizer:
    """A `tokenizers` tokenizer.json plus the facts the rest of the package needs (name, EOT, BOS, hash)."""

    kind = "hf"
    files = (METADATA_FILE, HF_FILE)

    def __init__(
        self,
        name: str,
        data: bytes,
        eot_token: str,
        *,
        bos_token: str | None = None,
        extra_special: tuple[str, ...] = (),
        where: str = HF_FILE,
    ):
        from tokenizers import AddedToken

        self.name, self.data, self.where = name, data, where
        self.file_sha256 = hashlib.sha256(data).hexdigest()
        self.backend = _parse(data, where)
        for token in (eot_token, bos_token):
            if token is not None and self.backend.token_to_id(token) is None:
                raise UserError(f"{where}: has no token {token}")
        # chat tokens the file lacks: appended after its vocabulary, so every id of the file keeps its meaning
        self.appended = tuple(dict.fromkeys(n for n in extra_special if self.backend.token_to_id(n) is None))
        if self.appended:
            self.backend.add_special_tokens(
                [AddedToken(n, special=True, normalized=False) for n in self.appended]
            )
        self.backend.encode_special_tokens = (
            True  # "<|endoftext|>" inside a document is text, never a boundary
        )
        self.eot_name, self.bos_name = eot_token, bos_token
        self.eot_id = self.backend.token_to_id(eot_token)
        self.bos_id = None if bos_token is None else self.backend.token_to_id(bos_token)
        names = [eot_token, *([bos_token] if bos_token is not None else []), *extra_special]
        self.special_tokens = {n: self.backend.token_to_id(n) for n in dict.fromkeys(names)}
        # every id the file can produce fits: normally get_vocab_size(with_added_tokens=True)
        ids = self.backend.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        identity = {
            "file_sha256": self.file_sha256,
            "eot_token": eot_token,
            "bos_token": bos_token,
            "special_tokens": self.special_tokens,
        }
        self.sha256 = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    @property
    def extra_special(self) -> tuple[str, ...]:
        """The special tokens pretrainer added to EOT and BOS (the chat format's), in order."""
        return tuple(n for n in self.special_tokens if n not in (self.eot_name, self.bos_name))

    def with_special(self, names: tuple[str, ...]) -> "HFTokenizer":
        """This tokenizer with `names` as special tokens: those the file has keep their ids,
        the others are appended."""
        return HFTokenizer(
            self.name,
            self.data,
            self.eot_name,
            bos_token=self.bos_name,
            extra_special=self.extra_special + tuple(n for n in names if n not in self.special_tokens),
            where=self.where,
        )

    def extends(self, base) -> bool:
        """Whether every id of `base` means the same here: the same file, EOT and BOS, and base's special
        tokens with the same ids (more may follow)."""
        return (
            isinstance(base, HFTokenizer)
            and self.file_sha256 == base.file_sha256
            and (self.eot_name, self.bos_name) == (base.eot_name, base.bos_name)
            and all(self.special_tokens.get(name) == i for name, i in base.special_tokens.items())
        )

    def special_id(self, name: str) -> int:
        if name not in self.special_tokens:
            raise UserError(
                f"tokenizer {self.name} has no special token {name}; prepare the data with --format chat"
            )
        return self.special_tokens[name]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 bytes each token id stands for (see the module docstring; special tokens 0)."""
        spec = json.loads(self.data)
        model = spec.get("model") or {}
        shape = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")], ensure_ascii=False)
        byte_level = '"ByteLevel"' in shape
        metaspace = '"Metaspace"' in shape or "\u2581" in shape  # sentencepiece's word marker, ▁
        subword_prefix = model.get("continuing_subword_prefix") if model.get("type") == "WordPiece" else None
        to_byte = set(_bytes_to_unicode().values())
        byte_fallback = re.compile(r"<0x[0-9A-Fa-f]{2}>") if model.get("byte_fallback") else None
        lengths = [0] * self.vocab_size
        for token, i in self.backend.get_vocab(with_added_tokens=False).items():
            if byte_level:  # one byte per character of the table (anything else: its UTF-8 bytes)
                n = (
                    len(token)
                    if to_byte.issuperset(token)
                    else sum(1 if c in to_byte else len(c.encode()) for c in token)
                )
            elif byte_fallback and byte_fallback.fullmatch(token):
                n = 1
            else:
                if subword_prefix and token.startswith(subword_prefix):
                    token = token[len(subword_prefix) :]
                n = len((token.replace("\u2581", " ") if metaspace else token).encode())
            lengths[i] = n
        for i, added in self.backend.get_added_tokens_decoder().items():
            if not (
                byte_fallback and byte_fallback.fullmatch(added.content)
            ):  # <0xNN> marked special is still a byte
                lengths[i] = 0 if added.special else len(added.content.encode())
        for i in self.special_tokens.values():
            lengths[i] = 0
        return lengths

    # --- saved form ---

    def metadata(self) -> dict:
        return {
            "kind": "hf",
            "name": self.name,
            "source": self.name.removeprefix("hf:"),
            "file_sha256": self.file_sha256,
            "eot_token": self.eot_name,
            "eot_id": self.eot_id,
            "bos_token": self.bos_name,
            "bos_id": self.bos_id,
            "extra_special": list(self.extra_special),
            "special_tokens": self.special_tokens,
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
        }

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / HF_FILE, self.data)  # unchanged: the source file, byte for byte
        atomic_write_bytes(directory / METADATA_FILE, (json.dumps(self.metadata(), indent=2) + "\n").encode())

    def is_saved_in(self, directory: Path) -> bool:
        directory = Path(directory)
        try:
            saved = json.loads((directory / METADATA_FILE).read_text())["sha256"]
        except (OSError, ValueError, KeyError):
            return False
        return saved == self.sha256 and (directory / HF_FILE).is_file()

    @classmethod
    def from_saved(cls, directory: Path, meta: dict, meta_path: Path) -> "HFTokenizer":
        path = Path(directory) / HF_FILE
        if not path.is_file():
            raise UserError(f"{path}: tokenizer file missing; re-run `pretrainer prepare` for this data")
        data = path.read_bytes()
        try:
            if hashlib.sha256(data).hexdigest() != meta["file_sha256"]:
                raise UserError(
                    f"{path}: does not match the sha256 in {meta_path.name}; the tokenizer files were changed"
                )
            tok = cls(
                meta["name"],
                data,
                meta["eot_token"],
                bos_token=meta["bos_token"],
                extra_special=tuple(meta["extra_special"]),
                where=str(path),
            )
        except (KeyError, TypeError) as e:
            raise UserError(
                f"{meta_path}: malformed tokenizer metadata ({type(e).__name__}: {e}); "
                f"re-run `pretrainer prepare`"
            ) from None
        if tok.sha256 != meta["sha256"]:
            raise UserError(f"{meta_path}: does not match {path.name}; the tokenizer files were changed")
        return tok

    def write_hf_files(self, out: Path, model_max_length: int | None = None) -> None:
        """Export: the tokenizer.json unchanged (with the appended chat tokens, if any)
        and a tokenizer_config.json."""
        if self.appended:
            with_appended = _parse(self.data, self.where)
            from tokenizers import AddedToken

            with_appended.add_special_tokens(
                [AddedToken(n, special=True, normalized=False) for n in self.appended]
            )
            atomic_write_bytes(Path(out) / HF_FILE, with_appended.to_str(pretty=True).encode())
        else:
            atomic_write_bytes(Path(out) / HF_FILE, self.data)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_name or self.eot_name,
            "eos_token": self.eot_name,
            "clean_up_tokenization_spaces": False,
        }
        from pretrainer.data.tokenizers.chat_format import (
            ASSISTANT_END,
            BOS,
            HF_CHAT_TEMPLATE,
            is_chat_tokenizer,
        )

        if is_chat_tokenizer(self):
            config.update(bos_token=BOS, eos_token=ASSISTANT_END, chat_template=HF_CHAT_TEMPLATE)
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        atomic_write_bytes(Path(out) / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())


# --- finding the file and choosing EOT / BOS ---


def _hub_file(repo: str, filename: str, required: bool = True) -> Path | None:
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename))
    except (
        Exception
    ) as e:  # not cached offline, no network, no such repo, gated, ...: one line, not a traceback
        if not required:
            return None
        where = (
            "the local Hugging Face hub cache (HF_HUB_OFFLINE is set)"
            if constants.HF_HUB_OFFLINE
            else "the Hugging Face hub"
        )
        raise UserError(
            f"--tokenizer hf:{repo}: no local directory {repo}, and {filename} could not be read from "
            f"{where} ({type(e).__name__}); download it once online (`hf download {repo} {filename}`), "
            f"or pass a local directory holding tokenizer.json: --tokenizer hf:DIR"
        ) from None


def _config_eos(config_path: Path | None) -> str | None:
    """tokenizer_config.json's eos_token (a string or an {"content": ...} object), if the file is there."""
    try:
        eos = json.loads(config_path.read_text()).get("eos_token") if config_path is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def _template(backend) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts (before, after) a sequence,
    found by encoding one character both ways."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if plain and full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def choose_eot_and_bos(
    backend, where: str, eot_token: str = "", config_eos=lambda: None
) -> tuple[str, str | None]:
    """-> (end-of-text token, BOS token or None): the order is in the module docstring."""
    added = backend.get_added_tokens_decoder()
    specials = [t.content for _, t in sorted(added.items()) if t.special]
    prefix, suffix = _template(backend)
    # only special tokens: an ordinary one would end a document wherever the text holds it, and count 0 bytes
    if eot_token:
        if eot_token not in specials:
            raise UserError(
                f"--eot-token {eot_token}: not a special token of {where}; "
                f"its special tokens: {_listing(specials)}"
            )
        eot = eot_token
    else:
        eot = next((name for name in EOT_NAMES if name in specials), None)
        if eot is None and len(suffix) == 1 and backend.id_to_token(suffix[0]) in specials:
            eot = backend.id_to_token(suffix[0])
        if eot is None:
            eos = config_eos()
            eot = eos if eos in specials else None
        if eot is None:
            raise UserError(
                f"{where}: no end-of-text token found among its special tokens ({_listing(specials)}); "
                f"pass --eot-token NAME"
            )
    bos = backend.id_to_token(prefix[0]) if len(prefix) == 1 else None
    return eot, (bos if bos in specials and bos != eot else None)


def load_hf_tokenizer(spec: str, eot_token: str = "") -> HFTokenizer:
    """--tokenizer hf:DIR_OR_REPO (a directory, a tokenizer.json, or a hub repo id) -> HFTokenizer."""
    source = spec.removeprefix("hf:")
    if not source:
        raise UserError(
            f"--tokenizer {spec}: give a directory holding tokenizer.json or a hub repo id, "
            f"e.g. hf:meta-llama/Llama-3.2-1B"
        )
    path = Path(source).expanduser()
    if path.is_file():
        file, config = path, lambda: _config_eos(path.parent / CONFIG_FILE)
    elif path.is_dir():
        file, config = path / HF_FILE, lambda: _config_eos(path / CONFIG_FILE)
        if not file.is_file():
            raise UserError(
                f"{file}: not found; "
                f"--tokenizer hf:DIR needs a directory holding a Hugging Face tokenizer.json"
            )
    elif re.fullmatch(r"(?:[\w.-]+/)?[\w.-]+", source) and not source.startswith("."):
        file, config = (
            _hub_file(source, HF_FILE),
            lambda: _config_eos(_hub_file(source, CONFIG_FILE, required=False)),
        )
    else:
        raise UserError(
            f"--tokenizer {spec}: {path} not found; "
            f"give a directory holding tokenizer.json or a hub repo id (ORG/NAME)"
        )
    try:
        data = file.read_bytes()
    except OSError as e:
        raise UserError(f"{file}: cannot be read ({e.strerror})") from None
    eot, bos = choose_eot_and_bos(_parse(data, str(file)), str(file), eot_token, config)
    return HFTokenizer(f"hf:{source}", data, eot, bos_token=bos, where=str(file))
