"""The evaluator of benchmarks/vs_nanochat.py (nanochat itself is never run here: it is fetched by the
benchmark's user): every byte of the validation text is scored, each token exactly once, against the
token that follows it, whatever the document's length against the window."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_nanochat.py"
spec = importlib.util.spec_from_file_location("vs_nanochat", SCRIPT)
vs_nanochat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_nanochat)

VOCAB = 1000
# lengths around the window (256) and stride (128): shorter, equal, one over, several windows
DOCS = ["x" * n for n in (1, 5, 255, 256, 257, 300, 385, 700)]


def encode(doc: str) -> list[int]:
    """Token i of a document is i + 1, so the next token is always the current one + 1 (start id 0)."""
    return [i + 1 for i in range(len(doc))]


def next_token_oracle(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot((x + 1) % VOCAB, VOCAB).float() * 60.0


@pytest.mark.parametrize("start_every_window", [False, True])
def test_every_token_is_scored_once_against_its_own_next_token(start_every_window):
    oracle = vs_nanochat.full_text_bpb(
        next_token_oracle, encode, 0, DOCS, start_every_window=start_every_window, vocab=VOCAB
    )
    assert oracle["tokens"] == sum(len(d) for d in DOCS) and oracle["bytes"] == sum(len(d) for d in DOCS)
    assert oracle["bpb"] < 1e-6  # a misaligned target (or a scored start token) would cost ~60 nats
    uniform = vs_nanochat.full_text_bpb(
        lambda x: torch.zeros(*x.shape, VOCAB), encode, 0, DOCS, start_every_window=start_every_window,
        vocab=VOCAB,
    )  # fmt: skip
    assert uniform["bpb"] == pytest.approx(uniform["tokens"] * math.log2(VOCAB) / uniform["bytes"])


@pytest.mark.parametrize("start_every_window", [False, True])
def test_windows_start_as_that_side_s_training_rows_do_and_keep_half_a_window_of_context(start_every_window):
    seen = []

    def recording(x):
        seen.extend(x.tolist())
        return next_token_oracle(x)

    vs_nanochat.full_text_bpb(
        recording, encode, 0, ["x" * 700], start_every_window=start_every_window, vocab=VOCAB
    )
    assert seen[0][0] == 0  # the document's first window starts at its start token
    for row in seen[1:]:
        assert (row[0] == 0) is start_every_window
        # the tokens before the scored ones (the last 128 of the window, or fewer at the end)
        assert row[-1] - row[1] >= vs_nanochat.SEQ_LEN - vs_nanochat.STRIDE - 1
