"""Loss spikes: injection drills, online detection on the device, and the batch forensics that
`pretrainer postmortem` reads.

Injection (`spike.inject_at_step = N`, for `spike.inject_batches` optimizer steps):
  rare  replace the batches with sequences drawn from the rarest 1% of the training vocabulary
        (by unigram count, cached in the data dir), weighted towards the rarest, which the model
        predicts worst: a high cross-entropy, large gradients on rarely-updated embeddings
  lr    multiply the learning rate by `spike.lr_factor`
  data  feed garbage: a constant-token batch (`spike.data_mode = "constant"`) or token ids past
        the vocabulary (`"out_of_range"`, rejected before they reach the embedding)
The injected batches are tied to a data position (like real bad data): a rollback that skips the
data window does not meet them again.

Detection: a rolling window of the last `spike.window` loss and grad-norm values (flagged values
left out), inactive until `spike.min_values` are in; a value above mean + `spike.sigmas` x std is a
spike, a non-finite value is one at once. Everything stays on the device: no host sync per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pretrainer.config import SpikeConfig
from pretrainer.io import atomic_write_bytes

RARE_FRACTION = 0.01  # "rare" = the rarest 1% of the vocabulary ids that occur in the training data
MAX_COUNT_TOKENS = 200_000_000  # unigram counts from at most this many tokens, in evenly spaced chunks


def unigram_counts(data_dir: Path, tokens: np.ndarray, vocab_size: int, train_sha256: str) -> np.ndarray:
    """Token counts over the train split, cached as DATA_DIR/unigram-counts.npy (keyed by the file's sha256)."""
    cache, meta_path = Path(data_dir) / "unigram-counts.npy", Path(data_dir) / "unigram-counts.json"
    try:
        if json.loads(meta_path.read_text()).get("train_sha256") == train_sha256:
            counts = np.load(cache)
            if len(counts) >= vocab_size:
                return counts
    except (OSError, ValueError):
        pass
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 22
    n_chunks = max(1, math.ceil(len(tokens) / chunk))
    stride = max(1, n_chunks // max(1, MAX_COUNT_TOKENS // chunk))
    for start in range(0, n_chunks, stride):
        part = np.asarray(tokens[start * chunk:(start + 1) * chunk])
        counts += np.bincount(part[part < vocab_size], minlength=vocab_size)[:vocab_size]
    try:  # a read-only data dir just means no cache
        import io

        buffer = io.BytesIO()
        np.save(buffer, counts)
        atomic_write_bytes(cache, buffer.getvalue())
        atomic_write_bytes(meta_path, json.dumps({"train_sha256": train_sha256, "counted_tokens": int(counts.sum())}).encode())
    except OSError:
        pass
    return counts


class UnigramStats:
    """Per-token log-probability, rarity and frequency rank from the training unigram counts."""

    def __init__(self, counts: np.ndarray):
        self.counts = counts
        self.vocab_size = len(counts)
        self.log_prob = np.log((counts + 1) / (counts.sum() + len(counts)))  # add-one smoothing: unseen ids are finite
        seen = np.flatnonzero(counts > 0)
        order = seen[np.argsort(counts[seen], kind="stable")]  # rarest first
        self.rare_ids = order[:max(1, int(round(RARE_FRACTION * len(seen))))]
        self.is_rare = np.zeros(len(counts), dtype=bool)
        self.is_rare[self.rare_ids] = True
        self.rank = np.empty(len(counts), dtype=np.int64)  # 0 = most frequent
        self.rank[np.argsort(-counts, kind="stable")] = np.arange(len(counts))
        self.bucket_edges = [0] + [2**i for i in range(int(math.log2(len(counts))) + 1) if 2**i < len(counts)] + [len(counts)]
        self.train_mean_log_prob = float((counts * self.log_prob).sum() / max(counts.sum(), 1))

    def rank_histogram(self, ids: np.ndarray) -> list[float]:
        """Fraction of the tokens in each frequency-rank bucket [0,1), [1,2), [2,4), ... (log-spaced)."""
        ranks = self.rank[ids]
        hist, _ = np.histogram(ranks, bins=self.bucket_edges)
        return (hist / max(len(ids), 1)).round(6).tolist()

    def train_rank_histogram(self) -> list[float]:
        hist, _ = np.histogram(self.rank, bins=self.bucket_edges, weights=self.counts)
        return (hist / max(self.counts.sum(), 1)).round(6).tolist()

    def batch_stats(self, ids: np.ndarray) -> dict:
        ids = ids.reshape(-1)
        valid = ids[(ids >= 0) & (ids < self.vocab_size)]
        top_fraction = float(np.bincount(valid).max() / len(ids)) if len(valid) else 1.0
        return {"batch_log_prob": float(self.log_prob[valid].mean()) if len(valid) else float("-inf"),
                "rare_fraction": float(self.is_rare[valid].mean()) if len(valid) else 0.0,
                "max_token_id": int(ids.max()), "top_token_fraction": top_fraction}


class SpikeInjector:
    def __init__(self, cfg: SpikeConfig, stats: UnigramStats, vocab_size: int, seq_len: int, seed: int):
        self.cfg, self.stats, self.vocab_size, self.seq_len = cfg, stats, vocab_size, seq_len
        self.generator = torch.Generator().manual_seed(seed + 7919)
        self.start_cursor: int | None = None  # the data position the bad window starts at
        weights = 1.0 / stats.counts[stats.rare_ids].astype(np.float64)  # rarer tokens more often
        self.rare_ids = torch.from_numpy(stats.rare_ids)
        self.rare_weights = torch.from_numpy(weights / weights.sum())

    def active(self, step: int, cursor: int, sequences_per_step: int) -> bool:
        """Is the step about to run (1-based `step`, reading from data position `cursor`) injected?"""
        if not self.cfg.inject_at_step:
            return False
        if self.start_cursor is None:
            if step != self.cfg.inject_at_step:
                return False
            self.start_cursor = cursor
        return self.start_cursor <= cursor < self.start_cursor + self.cfg.inject_batches * sequences_per_step

    def lr_factor(self) -> float:
        return self.cfg.lr_factor if self.cfg.inject_kind == "lr" else 1.0

    def replace(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.cfg.inject_kind == "lr":
            return micro_batches
        out = []
        for x, _ in micro_batches:
            shape = (x.size(0), self.seq_len + 1)
            if self.cfg.inject_kind == "rare":
                picks = torch.multinomial(self.rare_weights, shape[0] * shape[1], replacement=True, generator=self.generator)
                windows = self.rare_ids[picks].view(shape)
            elif self.cfg.data_mode == "constant":
                token = int(torch.randint(0, self.vocab_size, (1,), generator=self.generator))
                windows = torch.full(shape, token, dtype=torch.long)
            else:  # out_of_range: ids the embedding does not have
                windows = torch.randint(self.vocab_size, self.vocab_size + 1000, shape, generator=self.generator)
            out.append((windows[:, :-1], windows[:, 1:]))
        return out


@dataclass
class Flags:
    spike: torch.Tensor  # bool, on the device
    nonfinite: torch.Tensor


class SpikeMonitor:
    """Rolling mean + k sigma over loss and grad norm, all on the device (no host sync)."""

    def __init__(self, window: int, min_values: int, sigmas: float, device: torch.device):
        self.window, self.min_values, self.sigmas = window, min_values, sigmas
        self.values = torch.zeros(2, window, device=device)  # row 0 loss, row 1 grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Flags:
        current = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        nonfinite = ~torch.isfinite(current).all()
        valid = (torch.arange(self.window, device=current.device) < self.count).float()
        n = valid.sum().clamp(min=1)
        mean = (self.values * valid).sum(dim=1) / n
        std = (((self.values - mean[:, None]) * valid) ** 2).sum(dim=1).div((n - 1).clamp(min=1)).sqrt()
        threshold = mean + self.sigmas * torch.maximum(std, 1e-3 * mean.abs())
        spike = ((current > threshold).any() & (self.count >= self.min_values)) | nonfinite
        keep = ~spike  # flagged values stay out of the window, so a burst cannot hide itself
        slot = self.position.view(1, 1).expand(2, 1)
        self.values.scatter_(1, slot, torch.where(keep, current, self.values.gather(1, slot).squeeze(1)).view(2, 1))
        self.position.copy_((self.position + keep.long()) % self.window)
        self.count.copy_(torch.clamp(self.count + keep.long(), max=self.window))
        return Flags(spike=spike, nonfinite=nonfinite)

    def state_dict(self) -> dict:
        return {"values": self.values.tolist(), "count": int(self.count), "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        self.values.copy_(torch.tensor(state["values"], device=self.values.device))
        self.count.fill_(state["count"])
        self.position.fill_(state["position"])
