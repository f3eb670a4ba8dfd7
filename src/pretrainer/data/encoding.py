"""prepare's tokenizing and writing (data/prepare.py runs the pipeline): documents sent in batches to worker
processes that encode them (chat data rendered first), and each split's token file (with its loss mask for
chat data) written as the tokens arrive, then counted."""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from pretrainer.core.files import ChunkedSha256, naming
from pretrainer.data.sources import Piece
from pretrainer.data.tokenizers.base import Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer

BATCH_CHARS = 1 << 20  # documents are sent to workers in batches of about 1M characters
_worker_tokenizer: Tokenizer | None = None  # a worker process's own, loaded once (init_worker)


def document_batches(items: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], list[int]]]:
    batch, keys, chars = [], [], 0
    for text, key in items:
        batch.append(text)
        keys.append(key)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch, keys
            batch, keys, chars = [], [], 0
    if batch:
        yield batch, keys


def first_chars(docs: Iterator[str], limit: int) -> Iterator[str]:
    seen = 0
    for doc in docs:
        if seen >= limit:
            return
        seen += len(doc)
        yield doc


def init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = (
        "false"  # an hf: tokenizer's own threads: one process per core already
    )
    _worker_tokenizer = load_tokenizer(Path(tokenizer_dir))


def encode_batch(
    texts: list[str], starts: list[bool], tokenizer: Tokenizer | None = None
) -> tuple[np.ndarray, None, np.ndarray]:
    """-> (all tokens with an end-of-text after each document, no loss mask, per-item lengths).
    A Piece (a document the next item continues) gets no end-of-text; an item that starts a document
    (starts[i]) gets the tokenizer's BOS first, when it has one (hf: tokenizers such as Llama-3's)."""
    tok = tokenizer or _worker_tokenizer
    bos = [] if tok.bos_id is None else [tok.bos_id]
    ids = [
        (bos if start else []) + (x if isinstance(t, Piece) else x + [tok.eot_id])
        for t, start, x in zip(texts, starts, tok.encode_batch(texts))
    ]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, None, lengths


def render_chat_batch(
    conversations: list[str], starts: list[bool], tokenizer: Tokenizer | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """--format chat: canonical conversations -> (tokens in the chat template, loss mask, per-item lengths).
    Each starts with the template's <|bos|> (a conversation is never in pieces)."""
    from pretrainer.data.tokenizers.chat_format import render_batch

    return render_batch(conversations, tokenizer or _worker_tokenizer)


def encode_stream(
    batches: Iterator[tuple[list[str], list[int]]],
    tokenizer: Tokenizer,
    tokenizer_dir: Path,
    workers: int,
    encode=encode_batch,
):
    """-> ((tokens, mask or None, lengths), keys, document ends) per batch, in order."""
    previous_ended = True  # whether the item before the next one ended its document (the next one starts one)

    def starts(texts: list[str]) -> list[bool]:
        nonlocal previous_ended
        flags = [previous_ended] + [not isinstance(t, Piece) for t in texts[:-1]]
        previous_ended = not isinstance(texts[-1], Piece)
        return flags

    if workers <= 1:
        for texts, keys in batches:
            yield encode(texts, starts(texts), tokenizer), keys, [not isinstance(t, Piece) for t in texts]
        return
    # spawn, not fork: the parent may hold threads (tqdm, torch) that fork would copy mid-state
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=init_worker, initargs=(str(tokenizer_dir),)
    ) as pool:
        pending = deque()
        for texts, keys in batches:
            pending.append(
                (pool.submit(encode, texts, starts(texts)), keys, [not isinstance(t, Piece) for t in texts])
            )
            if len(pending) >= 2 * workers:
                future, keys, ends = pending.popleft()
                yield future.result(), keys, ends
        while pending:
            future, keys, ends = pending.popleft()
            yield future.result(), keys, ends


class SplitWriter:
    """One split's token file and, for chat data, its loss-mask file (one byte per token, aligned)."""

    def __init__(self, path: Path, dtype: np.dtype, with_mask: bool = False):
        self.path, self.dtype = path, dtype
        self.file = open(path, "wb")
        self.sha = ChunkedSha256()
        self.mask_path = path.with_suffix(".mask.bin") if with_mask else None
        self.mask_file = open(self.mask_path, "wb") if with_mask else None
        self.mask_sha = ChunkedSha256()
        self.documents = self.tokens = self.trained_tokens = 0

    def write(self, tokens: np.ndarray, documents: int = 1, mask: np.ndarray | None = None) -> None:
        """Tokens of consecutive items, `documents` of which end here (a Piece continues), and their mask."""
        data = tokens.astype(self.dtype).tobytes()
        try:
            self.file.write(data)
        except OSError as e:  # a full disk: say which file
            raise naming(e, self.path) from None
        self.sha.update(data)
        self.documents += documents
        self.tokens += len(tokens)
        if self.mask_file is not None:
            mask_bytes = mask.astype(np.uint8).tobytes()
            self.mask_file.write(mask_bytes)
            self.mask_sha.update(mask_bytes)
            self.trained_tokens += int(mask.sum())

    def close(self) -> dict:
        info = {
            "file": self.path.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "sha256": self.sha.hexdigest(),
            "chunk_sha256": self.sha.chunk_digests(),
        }  # per CHUNK_BYTES: data.verify = sampled
        for f in (self.file, self.mask_file):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        if self.mask_file is not None:
            info.update(
                mask_file=self.mask_path.name,
                mask_sha256=self.mask_sha.hexdigest(),
                mask_chunk_sha256=self.mask_sha.chunk_digests(),
                trained_tokens=self.trained_tokens,
            )
        return info
