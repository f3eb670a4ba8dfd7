"""Spike drills (spike.inject_at_step): rare-token, learning-rate and bad-data batches injected at a data
position, as real bad data would be (train/spikes.py describes each; SpikeGuard applies them)."""

from __future__ import annotations

import numpy as np
import torch

from pretrainer.config.schema import SpikeConfig
from pretrainer.data.unigram import UnigramStats


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

    def replace(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.cfg.inject_kind == "lr":
            return micro_batches
        out = []
        for x, _ in micro_batches:
            shape = (x.size(0), self.seq_len + 1)
            if self.cfg.inject_kind == "rare":
                picks = torch.multinomial(
                    self.rare_weights, shape[0] * shape[1], replacement=True, generator=self.generator
                )
                windows = self.rare_ids[picks].view(shape)
            elif self.cfg.data_mode == "constant":
                token = int(torch.randint(0, self.vocab_size, (1,), generator=self.generator))
                windows = torch.full(shape, token, dtype=torch.long)
            else:  # out_of_range: ids the embedding does not have
                windows = torch.randint(
                    self.vocab_size, self.vocab_size + 1000, shape, generator=self.generator
                )
            out.append((windows[:, :-1], windows[:, 1:]))
        return out
