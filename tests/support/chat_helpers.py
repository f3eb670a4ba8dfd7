"""Helpers shared by the tests split from test_chat.py."""

from __future__ import annotations

from pathlib import Path

from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus

SMALL = {
    "model.d_model": 64,
    "model.n_layer": 2,
    "model.n_head": 4,
    "model.n_kv_head": 2,
    "model.seq_len": 64,
}


def prepare_chat(
    path: Path,
    out: Path,
    tokenizer_from: Path | str = "",
    tokenizer: str = "gpt2",
    on_bad: str = "error",
    val_fraction: float = 0.05,
) -> Path:
    prepare(
        Corpus([str(path)], column="messages", on_bad=on_bad),
        tokenizer,
        out,
        val_fraction=val_fraction,
        workers=1,
        fmt="chat",
        tokenizer_from=str(tokenizer_from),
    )
    return out
