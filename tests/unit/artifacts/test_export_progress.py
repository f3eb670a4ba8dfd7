"""A large export (a 1B model's GGUF quantization, its safetensors) takes minutes: on a terminal it
draws a bar over the weights, never for small ones, never into a pipe or log."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import DOCS
from support.pty_terminal import drawn, terminal

from pretrainer.artifacts.checkpoint import model_weights
from pretrainer.artifacts.gguf_format import export_gguf
from pretrainer.artifacts.hf_format import export_hf
from pretrainer.config.schema import ModelConfig
from pretrainer.core import streams
from pretrainer.data.tokenizers.bpe import train_bpe
from pretrainer.model import Transformer

SHAPE = dict(arch="llama", vocab_size=384, seq_len=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2)
EXPORTS = {
    "gguf": lambda model, tok, out: export_gguf(
        model.cfg, model_weights(model), tok, out / "m.gguf", dtype="q8_0"
    ),
    "hf": lambda model, tok, out: export_hf(model.cfg, model_weights(model), tok, out / "hf"),
}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch.manual_seed(0)
    return Transformer(ModelConfig(**SHAPE)), train_bpe(iter(DOCS), 300)


@pytest.mark.parametrize("fmt", sorted(EXPORTS))
def test_a_large_export_draws_a_bar_over_its_weights_on_a_terminal(
    fmt, model_and_tokenizer, tmp_path, monkeypatch
):
    if fmt == "gguf":
        pytest.importorskip("gguf")  # a core dependency a site image running the cuda tests may lack
    model, tok = model_and_tokenizer
    master, tty = terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    EXPORTS[fmt](model, tok, tmp_path / "small")
    assert drawn(master) == ""  # a few seconds at most: no bar
    monkeypatch.setattr(streams, "BAR_FROM_BYTES", 0)  # as if it were large
    EXPORTS[fmt](model, tok, tmp_path / "large")
    shown = drawn(master)
    assert f"export {fmt}" in shown and "100%" in shown and "writing" in shown, repr(shown)
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        EXPORTS[fmt](model, tok, tmp_path / "logged")
    assert (tmp_path / "log").read_text() == ""
