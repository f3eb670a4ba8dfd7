"""A prepared data dir opened for training: its manifest read and checked (the token files' sizes, the
split counts, the tokenizer), and a mixture of several by weight (data.mixture) presented as one."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pretrainer.core.errors import UserError
from pretrainer.data.hub import is_hub_spec, pull
from pretrainer.data.token_files import open_tokens, split_files
from pretrainer.data.tokenizers.base import Tokenizer, metadata_path
from pretrainer.data.tokenizers.load import load_tokenizer

if TYPE_CHECKING:
    from pretrainer.data.loader import TokenSource


@dataclass
class DataDir:
    path: Path
    manifest: dict
    tokenizer: Tokenizer
    verified: dict | None = None  # what verify_data checked, for provenance

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    def provenance(self) -> dict:
        """Which data trains a model, for state.json and the report: the manifest's hash, the
        tokenizer's and each split's sha256 and counts."""
        from pretrainer.core.files import sha256_file

        tokenizer = self.manifest["tokenizer"]
        return {
            "dir": str(self.path.resolve()),
            "manifest_sha256": sha256_file(self.path / "manifest.json"),
            **({"verified": self.verified} if self.verified else {}),
            "tokenizer": {k: tokenizer.get(k) for k in ("name", "vocab_size", "sha256")},
            "splits": {
                name: {k: info.get(k) for k in ("sha256", "tokens", "documents")}
                for name, info in self.manifest["splits"].items()
            },
        }

    def tokens(self, split: str):
        """A split's tokens: an np.memmap, or ShardedTokens over several shards (data/token_files.py)."""
        files = split_files(self.manifest["splits"][split])
        return open_tokens(self.path, files, np.dtype(self.manifest["dtype"]))

    def mask(self, split: str):
        """A split's loss mask (chat data), read as tokens() is; None for text data."""
        files = split_files(self.manifest["splits"][split])
        return (
            open_tokens(self.path, files, np.dtype(np.uint8), "mask_file")
            if "mask_file" in files[0]
            else None
        )

    @property
    def is_chat(self) -> bool:
        return self.manifest.get("content") == "chat"

    @property
    def eot_id(self) -> int:
        return self.tokenizer.eot_id

    def source(self, split: str, seq_len: int, packing: str) -> TokenSource:
        """A split as a TokenSource: its tokens, its loss mask (chat data) and the packing."""
        from pretrainer.data.loader import TokenSource  # torch: opening and checking a data dir needs none

        return TokenSource(
            self.tokens(split),
            seq_len,
            packing=packing,
            mask=self.mask(split),
            eot_id=self.eot_id,
            name=f"{self.path.name}/{split}",
        )

    def sources(self, split: str, seq_len: int, packing: str) -> tuple[list[TokenSource], list[float]]:
        return [self.source(split, seq_len, packing)], [1.0]

    @property
    def parts(self) -> list["DataDir"]:
        return [self]

    @property
    def weights(self) -> list[float]:
        return [1.0]


class DataMixture:
    """Several prepared data dirs read as one stream by weight (data.mixture; MixtureSchedule). They
    share one tokenizer: each dir's must be the same merges, its special tokens a prefix of the one
    with the most (text data and chat data made with --tokenizer-from the same run mix)."""

    def __init__(self, parts: list[DataDir], weights: list[float]):
        self.parts, self.weights, self.verified = parts, weights, None
        self.tokenizer = max((part.tokenizer for part in parts), key=lambda t: len(t.special_tokens))
        for part in parts:
            if not self.tokenizer.extends(part.tokenizer):
                raise UserError(
                    f"{part.path}: tokenized by {part.tokenizer.name} ({part.tokenizer.sha256[:12]}), "
                    f"which is not the tokenizer of the other data.mixture sources; "
                    f"prepare it with --tokenizer-from one of them"
                )
        names = [part.path.name for part in parts]  # each source's label in logs (mix_share/LABEL): unique
        self.labels = [
            name if names.count(name) == 1 else f"{part.path.parent.name}/{name}"
            for part, name in zip(parts, names)
        ]
        self.labels = [
            label if self.labels.count(label) == 1 else f"{label}#{i}" for i, label in enumerate(self.labels)
        ]
        self.path = Path(
            "mixture(" + ",".join(f"{label}:{w:g}" for label, w in zip(self.labels, weights)) + ")"
        )
        splits = {
            split: {"tokens": sum(part.manifest["splits"][split]["tokens"] for part in parts)}
            for split in ("train", "val")
        }
        self.manifest = {
            "tokenizer": {"name": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size},
            "max_token_id": max(part.manifest["max_token_id"] for part in parts),
            "splits": splits,
        }

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def is_chat(self) -> bool:
        return any(part.is_chat for part in self.parts)

    @property
    def eot_id(self) -> int:
        return self.tokenizer.eot_id

    def provenance(self) -> dict:
        return {
            "mixture": [{"weight": w, **part.provenance()} for part, w in zip(self.parts, self.weights)],
            **({"verified": self.verified} if self.verified else {}),
        }

    def sources(self, split: str, seq_len: int, packing: str) -> tuple[list[TokenSource], list[float]]:
        sources = [part.source(split, seq_len, packing) for part in self.parts]
        for source, label in zip(sources, self.labels):
            source.name = label if split == "train" else f"{label}/{split}"
        return sources, list(self.weights)


def open_training_data(data_dir: str, mixture: list[dict]) -> DataDir | DataMixture:
    """data.dir, or data.mixture's dirs, opened and checked."""
    if mixture:
        return DataMixture(
            [open_data_dir(source["dir"]) for source in mixture], [source["weight"] for source in mixture]
        )
    return open_data_dir(data_dir)


def open_data_dir(path: str | Path) -> DataDir:
    """Open and check a directory written by `pretrainer prepare`."""
    if not str(path):
        raise UserError(
            "data.dir is not set; pass --data.dir=DIR, a directory written by `pretrainer prepare`"
        )
    if is_hub_spec(str(path)):  # pushed by `pretrainer push`: pulled (or found in the hub cache), verified
        path = pull(str(path), "dataset")
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"{path}: data dir not found; "
            f"run `pretrainer prepare --corpus ... --out {shlex.quote(str(path))}` first"
        )
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(
            f"{manifest_path}: missing; {path} is not a complete prepared data dir "
            f"(re-run `pretrainer prepare`)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["tokenizer"]
        splits = manifest["splits"]
        dtype = np.dtype(manifest["dtype"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(
            f"{manifest_path}: malformed manifest ({type(e).__name__}: {e}); re-run `pretrainer prepare`"
        ) from None
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != expected["vocab_size"] or tokenizer.sha256 != expected["sha256"]:
        raise UserError(
            f"{metadata_path(path)}: tokenizer/shard vocab mismatch (tokenizer {tokenizer.name}, vocab "
            f"{tokenizer.vocab_size}; manifest says {expected['name']}, vocab {expected['vocab_size']}); "
            f"the tokens were made by another tokenizer, re-run `pretrainer prepare`"
        )
    for split in ("train", "val"):
        try:
            files = split_files(splits[split])
            counted = sum(f["tokens"] for f in files)
        except (KeyError, TypeError) as e:
            raise UserError(
                f"{manifest_path}: malformed split {split!r} ({e}); re-run `pretrainer prepare`"
            ) from None
        if not files or counted != splits[split]["tokens"]:
            raise UserError(
                f"{manifest_path}: the {split} shards hold {counted} tokens, the split says "
                f"{splits[split]['tokens']}; re-run `pretrainer prepare`"
            )
        for info in files:
            for name, itemsize in (
                (info["file"], dtype.itemsize),
                *([(info["mask_file"], 1)] if "mask_file" in info else []),
            ):
                if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                    raise UserError(
                        f"{manifest_path}: split file {name!r} is not a file name inside {path}; a manifest "
                        f"names its files, never a path elsewhere; re-run `pretrainer prepare`"
                    )
                file = path / name
                size = file.stat().st_size if file.is_file() else -1
                if size != info["tokens"] * itemsize:
                    raise UserError(
                        f"{file}: holds {max(size, 0) // itemsize} tokens but manifest.json says "
                        f"{info['tokens']}; the data dir is incomplete or was changed, "
                        f"re-run `pretrainer prepare`"
                    )
    return DataDir(path, manifest, tokenizer)
