"""Documents -> token ids, a batch at a time (data/work_units.py calls these in each worker): plain text with
an end-of-text after each document, or conversations rendered in the chat template with their loss mask."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from pretrainer.data.sources import Piece
from pretrainer.data.tokenizers.base import Tokenizer

BATCH_CHARS = 1 << 20  # a worker encodes its documents in batches of about 1M characters


def first_chars(docs: Iterator[str], limit: int) -> Iterator[str]:
    seen = 0
    for doc in docs:
        if seen >= limit:
            return
        seen += len(doc)
        yield doc


def encode_batch(
    texts: list[str], starts: list[bool], tokenizer: Tokenizer
) -> tuple[np.ndarray, None, np.ndarray]:
    """-> (all tokens with an end-of-text after each document, no loss mask, per-item lengths).
    A Piece (a document the next item continues) gets no end-of-text; an item that starts a document
    (starts[i]) gets the tokenizer's BOS first, when it has one (hf: tokenizers such as Llama-3's)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    ids = [
        (bos if start else []) + (x if isinstance(t, Piece) else x + [tokenizer.eot_id])
        for t, start, x in zip(texts, starts, tokenizer.encode_batch(texts))
    ]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, None, lengths


def render_chat_batch(
    conversations: list[str], starts: list[bool], tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """--format chat: canonical conversations -> (tokens in the chat template, loss mask, per-item lengths).
    Each starts with the template's <|bos|> (a conversation is never in pieces)."""
    from pretrainer.data.tokenizers.chat_format import render_batch

    return render_batch(conversations, tokenizer)
