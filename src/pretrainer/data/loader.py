"""The training data stream over a prepared data dir.

The token file is cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted
targets): window i covers tokens [i*seq_len, i*seq_len + seq_len]. Each epoch visits every window
once in a random order drawn from (seed, epoch). The whole stream is a sequence of window ids,
and the loader's only state is `cursor`, the number of windows consumed so far by all ranks
together. Saving the cursor in a checkpoint makes resume exact: nothing re-seen, nothing skipped.

One optimizer step consumes micro_batch x grad_accum x world_size consecutive windows of the
stream; micro-step k on rank r takes the slice starting at (k * world_size + r) * micro_batch.
So 2 ranks x micro-batch b read exactly what 1 process with grad_accum 2 reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pretrainer.data.tokenizer import Tokenizer, metadata_path
from pretrainer.errors import UserError


@dataclass
class DataDir:
    path: Path
    manifest: dict
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    def provenance(self) -> dict:
        """Which data trains a model, for state.json and the report: the manifest's hash, the
        tokenizer's and each split's sha256 and counts."""
        from pretrainer.io import sha256_file

        tokenizer = self.manifest["tokenizer"]
        return {"dir": str(self.path.resolve()), "manifest_sha256": sha256_file(self.path / "manifest.json"),
                "tokenizer": {k: tokenizer.get(k) for k in ("name", "vocab_size", "sha256")},
                "splits": {name: {k: info.get(k) for k in ("sha256", "tokens", "documents")}
                           for name, info in self.manifest["splits"].items()}}

    def tokens(self, split: str) -> np.ndarray:
        info = self.manifest["splits"][split]
        return np.memmap(self.path / info["file"], dtype=np.dtype(self.manifest["dtype"]), mode="r")


def open_data_dir(path: str | Path) -> DataDir:
    """Open and check a directory written by `pretrainer prepare`."""
    if not str(path):
        raise UserError("data.dir is not set; pass --data.dir=DIR, a directory written by `pretrainer prepare`")
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: data dir not found; run `pretrainer prepare --corpus ... --out {path}` first")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"{manifest_path}: missing; {path} is not a complete prepared data dir (re-run `pretrainer prepare`)")
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["tokenizer"]
        splits = manifest["splits"]
        dtype = np.dtype(manifest["dtype"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{manifest_path}: malformed manifest ({type(e).__name__}: {e}); re-run `pretrainer prepare`") from None
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size != expected["vocab_size"] or tokenizer.sha256 != expected["sha256"]:
        raise UserError(f"{metadata_path(path)}: tokenizer/shard vocab mismatch (tokenizer {tokenizer.name}, vocab "
                        f"{tokenizer.vocab_size}; manifest says {expected['name']}, vocab {expected['vocab_size']}); "
                        f"the tokens were made by another tokenizer, re-run `pretrainer prepare`")
    for split in ("train", "val"):
        info = splits[split]
        file = path / info["file"]
        size = file.stat().st_size if file.is_file() else -1
        if size != info["tokens"] * dtype.itemsize:
            raise UserError(f"{file}: holds {max(size, 0) // dtype.itemsize} tokens but manifest.json says {info['tokens']}; "
                            f"the data dir is incomplete or was changed, re-run `pretrainer prepare`")
    return DataDir(path, manifest, tokenizer)


def _window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    return np.asarray(tokens[index * seq_len: index * seq_len + seq_len + 1], dtype=np.int64)


class SequenceLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, grad_accum: int,
                 world_size: int = 1, rank: int = 0, seed: int = 0, where: str = "train split", pin_memory: bool = False):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.pin_memory = pin_memory  # page-locked batches: the copy to the GPU runs asynchronously (non_blocking)
        self.micro_batch, self.grad_accum, self.world_size, self.rank = micro_batch, grad_accum, world_size, rank
        self.n_sequences = (len(tokens) - 1) // seq_len
        self.sequences_per_step = micro_batch * grad_accum * world_size
        if self.n_sequences < self.sequences_per_step:
            raise UserError(f"{where}: {len(tokens):,} tokens make {self.n_sequences} sequences of {seq_len}, fewer than one "
                            f"step needs ({micro_batch} x {grad_accum} x {world_size} ranks); use more data or a smaller batch")
        self.cursor = 0
        self.last_step_ids: list[list[int]] = []  # what next_step() read last, for audits (log.sequences)
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _sequence_id(self, position: int) -> int:
        epoch, offset = divmod(position, self.n_sequences)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_sequences)
            self._epoch = epoch
        return int(self._order[offset])

    def step_sequence_ids(self) -> list[list[int]]:
        """Window ids this rank reads in the next step, one list per micro-step (does not advance)."""
        return [[self._sequence_id(self.cursor + (k * self.world_size + self.rank) * self.micro_batch + j)
                 for j in range(self.micro_batch)] for k in range(self.grad_accum)]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = []
        self.last_step_ids = self.step_sequence_ids()
        for ids in self.last_step_ids:
            windows = torch.from_numpy(np.stack([_window(self.tokens, i, self.seq_len) for i in ids]))
            x, y = windows[:, :-1], windows[:, 1:]
            if self.pin_memory:  # contiguous first: a strided view would be staged through pageable memory
                x, y = x.contiguous().pin_memory(), y.contiguous().pin_memory()
            batches.append((x, y))
        self.cursor += self.sequences_per_step
        return batches

    @property
    def epoch(self) -> float:
        return self.cursor / self.n_sequences

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len, "n_sequences": self.n_sequences}

    def load_state_dict(self, state: dict) -> None:
        ours = {"seed": self.seed, "seq_len": self.seq_len, "n_sequences": self.n_sequences}
        theirs = {k: state.get(k) for k in ours}
        if ours != theirs:
            raise UserError(f"checkpoint data position was saved for {theirs}, but this run has {ours}; "
                            f"resume with the same data dir, model.seq_len and train.seed")
        self.cursor = int(state["cursor"])


def validation_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n_batches x micro_batch windows of the val split, in order: the same every time."""
    available = (len(tokens) - 1) // seq_len
    if available < 1:
        raise UserError(f"val split: {len(tokens)} tokens is shorter than one sequence of {seq_len}; "
                        f"prepare with a larger --val-fraction or use a smaller model.seq_len")
    count = min(available, n_batches * micro_batch)
    windows = torch.from_numpy(np.stack([_window(tokens, i, seq_len) for i in range(count)]))
    return [(windows[i:i + micro_batch, :-1], windows[i:i + micro_batch, 1:]) for i in range(0, count, micro_batch)]
