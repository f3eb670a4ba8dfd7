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

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pretrainer import IGNORE_INDEX
from pretrainer.core.errors import UserError
from pretrainer.data.token_files import byte_ranges

PACKINGS = ("concat", "document", "pad")


class TokenSource:
    """One split of one data dir, cut into sequences of seq_len inputs + seq_len targets.

    packing "concat":   window i is tokens [i*seq_len, i*seq_len + seq_len] (documents run into each
                        other; attention crosses their separators): pretraining's plain packing.
    packing "document": the same windows, but the trainer masks attention at each end-of-text and
                        restarts positions (model/transformer.py), and a target that starts a new
                        document (the token after an end-of-text) is not counted: no token sees or
                        predicts across a document boundary.
    packing "pad":      sequence i is document i alone, cut to seq_len + 1 tokens and padded; padding
                        is never a target (`pad_fraction` says how much of the batch it is).
    With a loss mask (chat data, data/tokenizers/chat_format.py) a target counts only where the mask of
    the token it predicts is 1.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        packing: str = "concat",
        mask: np.ndarray | None = None,
        eot_id: int = -1,
        name: str = "train",
    ):
        if packing not in PACKINGS:
            raise UserError(f"data.packing must be one of {', '.join(PACKINGS)}, got '{packing}'")
        self.tokens, self.seq_len, self.packing, self.mask, self.eot_id, self.name = (
            tokens,
            seq_len,
            packing,
            mask,
            eot_id,
            name,
        )
        self.counts_every_target = (
            mask is None and packing == "concat"
        )  # every target counts: no reading needed to count
        self._fds: dict[str, int] = {}  # warm()'s file descriptors
        self._fds_lock = threading.Lock()
        if packing == "pad":
            chunk = 1 << 24  # scanned in pieces: a full-split boolean array would be a byte per token
            ends = np.concatenate(
                [
                    start + np.flatnonzero(np.asarray(tokens[start : start + chunk]) == eot_id)
                    for start in range(0, len(tokens), chunk)
                ]
                or [np.zeros(0, dtype=np.int64)]
            )
            self.doc_starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
            self.doc_ends = ends.astype(np.int64) + 1
            self.n_sequences = len(ends)
            lengths = np.minimum(self.doc_ends - self.doc_starts - 1, seq_len)  # targets per padded sequence
            self.pad_fraction = 1.0 - float(lengths.sum()) / max(1, self.n_sequences * seq_len)
            self.truncated = int((self.doc_ends - self.doc_starts > seq_len + 1).sum())
        else:
            self.n_sequences = (len(tokens) - 1) // seq_len
            self.pad_fraction, self.truncated = 0.0, 0

    def warm(self, ids) -> None:
        """Read the bytes of windows `ids` once with os.pread, which waits for the disk without holding
        the GIL (copying from a memmap page-faults while holding it, stalling the training thread for
        every cold read of a network filesystem): windows() then copies from the page cache."""
        L = self.seq_len
        ranges = (
            [(int(self.doc_starts[i]), int(min(self.doc_ends[i], self.doc_starts[i] + L + 1))) for i in ids]
            if self.packing == "pad"
            else [(i * L, i * L + L + 1) for i in ids]
        )
        for array in (self.tokens, self.mask):
            if array is None:
                continue
            for start, end in ranges:
                for filename, offset, count in byte_ranges(array, start, end):
                    os.pread(self._fd(filename), count, offset)

    def _fd(self, filename: str) -> int:
        with self._fds_lock:  # a stale prefetch and the training thread may both get here
            fd = self._fds.get(filename)
            if fd is None:
                fd = self._fds[filename] = os.open(filename, os.O_RDONLY)
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def windows(self, ids) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (windows (len(ids), seq_len + 1) of int64 ids,
        targets kept (len(ids), seq_len) or None: all)."""
        L = self.seq_len
        if self.packing == "pad":
            windows = np.full((len(ids), L + 1), self.eot_id, dtype=np.int64)
            keep = np.zeros((len(ids), L), dtype=bool)
            for row, i in enumerate(ids):
                start, end = self.doc_starts[i], min(self.doc_ends[i], self.doc_starts[i] + L + 1)
                windows[row, : end - start] = self.tokens[start:end]
                keep[row, : end - start - 1] = True if self.mask is None else self.mask[start + 1 : end] == 1
            return windows, keep
        windows = np.stack([np.asarray(self.tokens[i * L : i * L + L + 1], dtype=np.int64) for i in ids])
        if self.counts_every_target:
            return windows, None
        keep = np.ones((len(ids), L), dtype=bool)
        if self.mask is not None:
            keep &= np.stack([np.asarray(self.mask[i * L + 1 : i * L + L + 1]) == 1 for i in ids])
        if self.packing == "document":
            keep &= (
                windows[:, :-1] != self.eot_id
            )  # the first token of the next document: not predicted across the boundary
        return windows, keep


def inputs_and_targets(windows: np.ndarray, keep: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, shifted targets), targets not kept set to IGNORE_INDEX."""
    windows = torch.from_numpy(windows)
    x, y = windows[:, :-1], windows[:, 1:]
    if keep is not None:
        y = y.masked_fill(~torch.from_numpy(keep), IGNORE_INDEX)
    return x, y


class MixtureSchedule:
    """Which source each position of the stream reads: position p -> the source whose cumulative
    weight interval holds frac(p x golden ratio + offset(seed)). The golden-ratio (Kronecker) sequence
    is the most evenly spread there is: over any n consecutive positions each source's share is
    within O(log n / n) of its weight (1,000 sequences: well within 1%), deterministic, with no state
    but the position, so a resumed run reads the identical stream."""

    PHI = (5**0.5 - 1) / 2

    def __init__(self, weights: list[float], seed: int):
        total = float(sum(weights))
        self.bounds = np.cumsum(np.asarray(weights, dtype=np.float64) / total)[:-1]
        self.offset = float(np.random.default_rng([seed, 7919]).random())
        self._counted_to, self._counts = 0, np.zeros(len(weights), dtype=np.int64)

    def sources(self, start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop, dtype=np.float64)
        return np.searchsorted(self.bounds, np.modf(positions * self.PHI + self.offset)[0], side="right")

    def counts(self, position: int) -> np.ndarray:
        """Positions before `position` that each source served (cached: the stream mostly moves forward)."""
        if position < self._counted_to:
            self._counted_to, self._counts = 0, np.zeros_like(self._counts)
        while self._counted_to < position:
            stop = min(position, self._counted_to + 2**20)
            self._counts += np.bincount(self.sources(self._counted_to, stop), minlength=len(self._counts))
            self._counted_to = stop
        return self._counts.copy()


class SequenceLoader:
    def __init__(
        self,
        sources,
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        where: str = "train split",
        pin_memory: bool = False,
        weights: list[float] | None = None,
        prefetch: bool = False,
    ):
        """`sources`: a token array (one source, concat packing), a TokenSource, or a list of TokenSources
        mixed by `weights` (data.mixture). prefetch: read the next step in a background thread while this
        one trains (the step read is a function of the cursor alone, so the batches are the same)."""
        if isinstance(sources, np.ndarray):
            sources = TokenSource(sources, seq_len)
        self.sources = sources if isinstance(sources, list) else [sources]
        self.seq_len, self.seed = seq_len, seed
        self.pin_memory = (
            pin_memory  # page-locked batches: the copy to the GPU runs asynchronously (non_blocking)
        )
        self.micro_batch, self.grad_accum, self.world_size, self.rank = (
            micro_batch,
            grad_accum,
            world_size,
            rank,
        )
        self.sequences_per_step = micro_batch * grad_accum * world_size
        self.mixture = (
            MixtureSchedule(weights or [1.0] * len(self.sources), seed) if len(self.sources) > 1 else None
        )
        self.n_sequences = sum(source.n_sequences for source in self.sources)
        for source in self.sources:
            if source.n_sequences < (self.sequences_per_step if self.mixture is None else 1):
                tokens = len(source.tokens)
                raise UserError(
                    f"{where if self.mixture is None else source.name}: {tokens:,} tokens make "
                    f"{source.n_sequences} sequences of {seq_len}, fewer than one step needs "
                    f"({micro_batch} x {grad_accum} x {world_size} ranks); use more data or a smaller batch"
                )
        self.counts_every_target = all(source.counts_every_target for source in self.sources)
        self.cursor = 0
        self.last_step_ids: list[list[int]] = []  # what next_step() read last, for audits (log.sequences)
        self.last_step_counts: tuple[list[int], int] = (
            [],
            0,
        )  # counted targets: this rank's per micro-step, the step's
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its permutation)
        self.prefetch = prefetch
        self._lock = (
            threading.Lock()
        )  # the stream's caches (orders, the mixture's counts): one thread at a time
        self._ahead: tuple[int, Future] | None = None  # (cursor, its step being read)
        self._pool: ThreadPoolExecutor | None = None

    def _local_id(self, source: int, position: int) -> int:
        """The window id of the source's `position`-th sequence: every window once per epoch, in an
        order drawn from (seed, epoch) (one source) or (seed, source, epoch) (a mixture)."""
        n = self.sources[source].n_sequences
        epoch, offset = divmod(position, n)
        if self._orders.get(source, (None,))[0] != epoch:
            key = [self.seed, epoch] if self.mixture is None else [self.seed, source, epoch]
            self._orders[source] = (epoch, np.random.default_rng(key).permutation(n))
        return int(self._orders[source][1][offset])

    def _stream(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, window id) of stream positions start..stop-1."""
        if self.mixture is None:
            return [(0, self._local_id(0, p)) for p in range(start, stop)]
        which = self.mixture.sources(start, stop)
        seen = self.mixture.counts(start)
        out = []
        for s in which.tolist():
            out.append((s, self._local_id(s, int(seen[s]))))
            seen[s] += 1
        return out

    def _rank_slices(self, stream: list, rank: int) -> list[list[tuple[int, int]]]:
        """Micro-step k on rank r reads the step's slice starting at (k * world_size + r) * micro_batch."""
        b = self.micro_batch
        return [
            stream[(k * self.world_size + rank) * b : (k * self.world_size + rank + 1) * b]
            for k in range(self.grad_accum)
        ]

    def step_sequence_ids(self) -> list[list[int]]:
        """Window ids this rank reads in the next step, one list per micro-step (does not advance)."""
        with self._lock:
            stream = self._stream(self.cursor, self.cursor + self.sequences_per_step)
        return [[i for _, i in micro] for micro in self._rank_slices(stream, self.rank)]

    def _read(self, micro: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray | None]:
        """Windows and kept targets of one micro-batch, row by row in stream order (sources may differ)."""
        if len({s for s, _ in micro}) == 1:
            return self.sources[micro[0][0]].windows([i for _, i in micro])
        parts = [self.sources[s].windows([i]) for s, i in micro]
        keep = [k if k is not None else np.ones((1, self.seq_len), dtype=bool) for _, k in parts]
        return np.concatenate([w for w, _ in parts]), np.concatenate(keep)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step at the cursor (read ahead by the prefetch thread when it read this cursor: one moved
        by a rollback or a spike skip is read here instead); then the next one starts reading."""
        cursor, ahead, self._ahead = self.cursor, self._ahead, None
        step = ahead[1].result() if ahead is not None and ahead[0] == cursor else self._read_step(cursor)
        self.last_step_ids, self.last_step_counts = step["ids"], step["counts"]
        self.cursor = cursor + self.sequences_per_step
        if self.prefetch:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader-prefetch")
            self._ahead = (self.cursor, self._pool.submit(self._read_step, self.cursor))
        return step["batches"]

    def _read_step(self, cursor: int) -> dict:
        """The step at `cursor`: this rank's micro-batches, their window ids and counted targets. A
        function of the cursor alone (either thread may run it)."""
        with self._lock:
            stream = self._stream(cursor, cursor + self.sequences_per_step)
        mine = self._rank_slices(stream, self.rank)
        for source, ids in self._by_source(stream if not self.counts_every_target else sum(mine, [])).items():
            self.sources[source].warm(ids)
        batches, counts = [], []
        for micro in mine:
            x, y = inputs_and_targets(*self._read(micro))
            if self.pin_memory:  # contiguous first: a strided view would be staged through pageable memory
                x, y = x.contiguous().pin_memory(), y.contiguous().pin_memory()
            batches.append((x, y))
            counts.append(y.numel() if self.counts_every_target else int((y != IGNORE_INDEX).sum()))
        return {
            "batches": batches,
            "ids": [[i for _, i in micro] for micro in mine],
            "counts": (counts, self._step_count(stream, counts)),
        }

    @staticmethod
    def _by_source(stream: list[tuple[int, int]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for source, i in stream:
            out.setdefault(source, []).append(i)
        return out

    def close(self) -> None:
        """Stop reading ahead (a read in flight finishes) and close the sources' files."""
        self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for source in self.sources:
            source.close()

    def _step_count(self, stream: list, mine: list[int]) -> int:
        """Counted targets of the whole step, every rank's: each rank reads the others' windows from
        the same files (no collective, no device sync) so that every rank divides by the same number."""
        if self.counts_every_target:
            return self.sequences_per_step * self.seq_len
        total = sum(mine)
        for rank in range(self.world_size):
            if rank != self.rank:
                for micro in self._rank_slices(stream, rank):
                    _, keep = self._read(micro)
                    total += len(micro) * self.seq_len if keep is None else int(keep.sum())
        return total

    @property
    def epoch(self) -> float:
        return self.cursor / self.n_sequences

    def shares(self) -> dict[str, float]:
        """The realised share of each source in the sequences read so far (a mixture)."""
        if self.mixture is None or self.cursor == 0:
            return {}
        with self._lock:
            counts = self.mixture.counts(self.cursor)
        return {source.name: int(c) / self.cursor for source, c in zip(self.sources, counts)}

    def state_dict(self) -> dict:
        state = {
            "cursor": self.cursor,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "n_sequences": self.n_sequences,
        }
        return {**state, **self._layout()}

    def _layout(self) -> dict:
        """What else decides the stream, beyond one concat source (absent then: older checkpoints match)."""
        layout = {}
        if any(source.packing != "concat" for source in self.sources):
            layout["packing"] = [source.packing for source in self.sources]
        if self.mixture is not None:
            layout["sources"] = [
                {"name": source.name, "n_sequences": source.n_sequences} for source in self.sources
            ]
            layout["bounds"] = self.mixture.bounds.tolist()
        return layout

    def load_state_dict(self, state: dict) -> None:
        """The data position of a checkpoint. One saved at a shorter seq_len (a context extension) carries
        over in tokens: the cursor becomes the same number of tokens in windows of this seq_len, in the same
        epoch (whose windows of the new length are drawn in an order of their own)."""
        saved_len = state.get("seq_len")
        if saved_len and saved_len < self.seq_len and self.mixture is None and "sources" not in state:
            if self.sources[0].packing == "pad":  # a sequence is a document at any length
                state = {**state, "seq_len": self.seq_len, "n_sequences": self.n_sequences}
            else:
                epoch, position = divmod(int(state["cursor"]), int(state["n_sequences"]))
                cursor = epoch * self.n_sequences + position * saved_len // self.seq_len
                state = {**state, "cursor": cursor, "seq_len": self.seq_len, "n_sequences": self.n_sequences}
        ours = {"seed": self.seed, "seq_len": self.seq_len, "n_sequences": self.n_sequences, **self._layout()}
        theirs = {k: state.get(k) for k in ours}
        if ours != theirs or set(self._layout()) != {
            k for k in ("packing", "sources", "bounds") if k in state
        }:
            raise UserError(
                f"checkpoint data position was saved for {theirs}, but this run has {ours}; "
                f"resume with the same data dir (or mixture), data.packing, model.seq_len and train.seed"
            )
        self.cursor = int(state["cursor"])


def validation_batches(
    source, seq_len: int, micro_batch: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n_batches x micro_batch sequences of the val split (a token array, or a TokenSource),
    in order: the same every time."""
    if isinstance(source, np.ndarray):
        source = TokenSource(source, seq_len, name="val split")
    if source.n_sequences < 1:
        raise UserError(
            f"{source.name}: {len(source.tokens)} tokens is shorter than one sequence of {seq_len}; "
            f"prepare with a larger --val-fraction or use a smaller model.seq_len"
        )
    count = min(source.n_sequences, n_batches * micro_batch)
    x, y = inputs_and_targets(*source.windows(range(count)))
    return [(x[i : i + micro_batch], y[i : i + micro_batch]) for i in range(0, count, micro_batch)]
