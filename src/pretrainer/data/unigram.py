"""Token statistics of a train split: unigram counts (counted once per split, cached in the user's cache
dir, never in the data dir) and what follows from them: per-token log-probability, the rarest ids,
frequency ranks and their histogram. The spike guard's drills draw rare tokens from them, and its
batch forensics compare a batch with them (train/spikes.py); RUN_DIR/unigram.json is their summary.

    stats = training_unigram(data, vocab_size)   # a prepared (or mixed) data dir's train split
    stats.batch_stats(ids), stats.rare_ids, stats.summary()
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from pretrainer.core.files import atomic_write_bytes
from pretrainer.data.tokenizers.base import cache_dir

RARE_FRACTION = 0.01  # "rare" = the rarest 1% of the vocabulary ids that occur in the training data
MAX_COUNT_TOKENS = 200_000_000  # unigram counts from at most this many tokens, in evenly spaced chunks


def unigram_cache_path(train_sha256: str, vocab_size: int) -> Path:
    """Where the counts of a train split are cached: the user's cache dir ($PRETRAINER_CACHE), never
    the data dir, which may be read-only or shared and should hold only what `prepare` wrote."""
    return cache_dir() / "unigram" / f"{train_sha256}-{vocab_size}.npy"


def count_tokens(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Counts of ids < vocab_size in at most MAX_COUNT_TOKENS tokens, read in evenly spaced chunks."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 22
    n_chunks = max(1, math.ceil(len(tokens) / chunk))
    stride = max(1, n_chunks // max(1, MAX_COUNT_TOKENS // chunk))
    for start in range(0, n_chunks, stride):
        part = np.asarray(tokens[start * chunk : (start + 1) * chunk])
        counts += np.bincount(part[part < vocab_size], minlength=vocab_size)[:vocab_size]
    return counts


def unigram_counts(tokens: np.ndarray, vocab_size: int, train_sha256: str) -> np.ndarray:
    """Token counts over the train split (keyed by its sha256), cached at unigram_cache_path: a
    derived cache never goes into the input data dir (which may be read-only or shared)."""
    cache = unigram_cache_path(train_sha256, vocab_size)
    try:
        counts = np.load(cache)
        if counts.shape == (vocab_size,):
            return counts
    except (OSError, ValueError, EOFError):
        pass
    counts = count_tokens(tokens, vocab_size)
    try:  # an unwritable cache dir only means counting again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, counts)
        atomic_write_bytes(cache, buffer.getvalue())
    except OSError:
        pass
    return counts


class UnigramStats:
    """Per-token log-probability, rarity and frequency rank from the training unigram counts."""

    def __init__(self, counts: np.ndarray):
        self.counts = counts
        self.vocab_size = len(counts)
        # add-one smoothing: unseen ids are finite
        self.log_prob = np.log((counts + 1) / (counts.sum() + len(counts)))
        seen = np.flatnonzero(counts > 0)
        order = seen[np.argsort(counts[seen], kind="stable")]  # rarest first
        self.rare_ids = order[: max(1, int(round(RARE_FRACTION * len(seen))))]
        self.is_rare = np.zeros(len(counts), dtype=bool)
        self.is_rare[self.rare_ids] = True
        self.rank = np.empty(len(counts), dtype=np.int64)  # 0 = most frequent
        self.rank[np.argsort(-counts, kind="stable")] = np.arange(len(counts))
        self.bucket_edges = (
            [0] + [2**i for i in range(int(math.log2(len(counts))) + 1) if 2**i < len(counts)] + [len(counts)]
        )
        self.train_mean_log_prob = float((counts * self.log_prob).sum() / max(counts.sum(), 1))

    def rank_histogram(self, ids: np.ndarray) -> list[float]:
        """Fraction of the tokens in each frequency-rank bucket [0,1), [1,2), [2,4), ... (log-spaced)."""
        ranks = self.rank[ids]
        hist, _ = np.histogram(ranks, bins=self.bucket_edges)
        return (hist / max(len(ids), 1)).round(6).tolist()

    def train_rank_histogram(self) -> list[float]:
        hist, _ = np.histogram(self.rank, bins=self.bucket_edges, weights=self.counts)
        return (hist / max(self.counts.sum(), 1)).round(6).tolist()

    def summary(self) -> dict:
        """The training distribution, written to RUN_DIR/unigram.json for post-mortems."""
        return {
            "bucket_edges": self.bucket_edges,
            "train_rank_histogram": self.train_rank_histogram(),
            "train_mean_log_prob": self.train_mean_log_prob,
            "rare_ids": self.rare_ids.tolist(),
        }

    def batch_stats(self, ids: np.ndarray) -> dict:
        ids = ids.reshape(-1)
        valid = ids[(ids >= 0) & (ids < self.vocab_size)]
        top_fraction = float(np.bincount(valid).max() / len(ids)) if len(valid) else 1.0
        return {
            "batch_log_prob": float(self.log_prob[valid].mean()) if len(valid) else float("-inf"),
            "rare_fraction": float(self.is_rare[valid].mean()) if len(valid) else 0.0,
            "max_token_id": int(ids.max()),
            "top_token_fraction": top_fraction,
        }


def training_unigram(data, vocab_size: int) -> UnigramStats:
    """Token statistics of the train split (cached in the cache dir): spike drills and batch forensics.
    A mixture's are its sources' frequencies mixed by weight, scaled to its train tokens."""
    counts = [
        unigram_counts(part.tokens("train"), vocab_size, part.manifest["splits"]["train"]["sha256"])
        for part in data.parts
    ]
    if len(counts) == 1:
        return UnigramStats(counts[0])
    mixed = sum(w * c / max(1, c.sum()) for w, c in zip(data.weights, counts)) / sum(data.weights)
    return UnigramStats(np.rint(mixed * data.manifest["splits"]["train"]["tokens"]).astype(np.int64))
