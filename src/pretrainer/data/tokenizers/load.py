"""Which tokenizer: from a `--tokenizer` spec (gpt2, bpe:N, hf:DIR_OR_REPO), or the one saved in a
directory (a data dir, RUN_DIR/tokenizer), whichever kind it is."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.data.tokenizers.base import EOT, metadata_path
from pretrainer.data.tokenizers.bpe import Tokenizer, load_gpt2, train_bpe
from pretrainer.data.tokenizers.hf import HFTokenizer, load_hf_tokenizer


def tokenizer_from_spec(
    spec: str, training_texts: Iterator[str] | None = None, eot_token: str = ""
) -> Tokenizer:
    if spec.startswith("hf:"):
        return load_hf_tokenizer(spec, eot_token)
    if eot_token:
        raise UserError(
            f"--eot-token {eot_token}: only for --tokenizer hf:...; {spec} separates documents with {EOT}"
        )
    if spec == "gpt2":
        return load_gpt2()
    if spec.startswith("bpe:"):
        try:
            vocab_size = int(spec[4:])
        except ValueError:
            raise UserError(f"--tokenizer {spec}: expected bpe:N with N an integer, e.g. bpe:4096") from None
        assert training_texts is not None, "a trained BPE needs the corpus"
        return train_bpe(training_texts, vocab_size)
    raise UserError(
        f"--tokenizer {spec}: unknown tokenizer; use gpt2, bpe:N (e.g. bpe:4096) or hf:DIR_OR_REPO"
    )


def load_tokenizer(directory: Path) -> Tokenizer | HFTokenizer:
    """The tokenizer saved in `directory`: a Tokenizer,
    or an HFTokenizer where the metadata says kind "hf"."""
    directory = Path(directory)
    meta_path = metadata_path(directory)
    if not meta_path.is_file():
        raise UserError(f"{meta_path}: tokenizer file missing; re-run `pretrainer prepare` for this data")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(
            f"{meta_path}: malformed tokenizer metadata ({e}); re-run `pretrainer prepare`"
        ) from None
    if isinstance(meta, dict) and meta.get("kind") == "hf":
        return HFTokenizer.from_saved(directory, meta, meta_path)
    return Tokenizer.from_saved(directory, meta, meta_path)
