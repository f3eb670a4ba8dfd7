"""Issue 14: is the model any good? Bits per byte: nats of the scored tokens over the UTF-8 bytes
of exactly the text they stand for, so models with different tokenizers compare."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrainer.config import ModelConfig
from pretrainer.data.tokenizer import Tokenizer, load_gpt2, train_bpe
from pretrainer.eval.loss import evaluate, token_bytes_tensor
from pretrainer.model import Transformer

TEXTS = ["naïve café — crème brûlée, 日本語のテキスト, emoji 😀🎉 and ascii words " * 3 + f"doc {i}" for i in range(60)]


def bpe() -> Tokenizer:
    return train_bpe(iter(TEXTS), 300)


def gpt2() -> Tokenizer:
    try:
        return load_gpt2()
    except Exception as e:  # noqa: BLE001 (no ranks: `make setup` fetches them)
        pytest.skip(f"GPT-2 ranks not available: {e}")


@pytest.mark.parametrize("make_tokenizer", [bpe, gpt2], ids=["bpe", "gpt2"])
def test_token_bytes_are_the_utf8_bytes_of_exactly_the_scored_text(make_tokenizer):
    tok = make_tokenizer()
    lengths = tok.token_byte_lengths()
    doc_a, doc_b = TEXTS[0], TEXTS[1]
    ids = tok.encode(doc_a) + [tok.eot_id] + tok.encode(doc_b)
    assert sum(lengths[i] for i in ids) == len(doc_a.encode()) + len(doc_b.encode())  # the separator has no bytes
    pieces = [tok.encoding.decode_single_token_bytes(i) if i != tok.eot_id else b"" for i in ids]
    split_chars = 0
    for start in range(0, len(ids), 7):  # spans cut anywhere: mid-document, mid-character
        for end in range(start + 1, len(ids) + 1, 11):
            assert sum(lengths[i] for i in ids[start:end]) == len(b"".join(pieces[start:end]))
    for piece in pieces:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            split_chars += 1
    assert split_chars > 0  # some token holds part of a multi-byte character: its bytes still count exactly


def test_bits_per_byte_by_hand():
    tok = bpe()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size + 4, seq_len=32, d_model=32, n_layer=2, n_head=2))  # padded
    stream = []
    for text in TEXTS[:6]:
        stream += tok.encode(text) + [tok.eot_id]
    windows = torch.tensor(stream[: 4 * 33]).view(4, 33)
    batches = [(windows[:2, :-1], windows[:2, 1:]), (windows[2:, :-1], windows[2:, 1:])]
    scores = evaluate(model, batches, torch.device("cpu"), None, token_bytes_tensor(tok, model.cfg.vocab_size))

    nats, n_bytes, all_nats, n_tokens = 0.0, 0, 0.0, 0
    for x, y in batches:  # plain reference: full logits, per-token cross-entropy, bytes from the ranks
        with torch.no_grad():
            logits, _ = model(x)
        losses = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="none")
        for loss, target in zip(losses.tolist(), y.flatten().tolist()):
            all_nats, n_tokens = all_nats + loss, n_tokens + 1
            if target != tok.eot_id:  # the separator stands for no text
                nats += loss
                n_bytes += len(tok.encoding.decode_single_token_bytes(target))
    assert n_bytes > n_tokens  # multi-byte tokens: bytes and tokens differ
    assert scores["val_bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)
    assert scores["val_loss"] == pytest.approx(all_nats / n_tokens, rel=1e-5)
