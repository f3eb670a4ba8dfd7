"""A split's token files read as one array: the shards `prepare` writes (train-00000.bin, ...) or the single
train.bin of a data dir prepared before shards, memory-mapped.

    files = split_files(manifest["splits"]["train"])     # [{"file", "tokens", "sha256", ...}, ...]
    tokens = open_tokens(data_dir, files, dtype)          # np.memmap (one file) or ShardedTokens

ShardedTokens answers what the loader asks of a token array: len, a slice (copied together where it
crosses a shard boundary), dtype, and which bytes of which files a range is (for os.pread)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def split_files(info: dict) -> list[dict]:
    """A split's files in order, each {"file", "tokens", "sha256", "chunk_sha256"} (+ the mask's "mask_file",
    "mask_sha256", "mask_chunk_sha256"): its "shards", or the split itself in the single-file layout."""
    return list(info["shards"]) if "shards" in info else [info]


class ShardedTokens:
    """Memory-mapped shards read as one 1-D array (the shards' concatenation)."""

    def __init__(self, shards: list[np.memmap]):
        self.shards = shards
        self.starts = [0]
        for shard in shards:
            self.starts.append(self.starts[-1] + len(shard))
        self.dtype, self.itemsize = shards[0].dtype, shards[0].itemsize

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice):
            raise TypeError("ShardedTokens takes slices")
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens takes contiguous slices")
        pieces = [shard[a:b] for shard, a, b in self._pieces(start, stop)]
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[np.memmap, int, int]]:
        """(shard, start, stop within it) for the tokens [start, stop), in order."""
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop and i < len(self.shards):
            end = min(stop, self.starts[i + 1])
            yield self.shards[i], start - self.starts[i], end - self.starts[i]
            start, i = end, i + 1

    def byte_ranges(self, start: int, stop: int) -> Iterator[tuple[str, int, int]]:
        """(file name, byte offset, byte count) of the tokens [start, stop)."""
        for shard, a, b in self._pieces(start, stop):
            yield shard.filename, shard.offset + a * self.itemsize, (b - a) * self.itemsize


def byte_ranges(array, start: int, stop: int) -> Iterator[tuple[str, int, int]]:
    """Where the elements [start, stop) of a memory-mapped array or ShardedTokens are on disk (nothing for
    an array in memory)."""
    if isinstance(array, ShardedTokens):
        yield from array.byte_ranges(start, stop)
    elif isinstance(array, np.memmap) and array.filename:
        yield array.filename, array.offset + start * array.itemsize, (stop - start) * array.itemsize


def open_tokens(directory: Path, files: list[dict], dtype: np.dtype, key: str = "file"):
    """The files' arrays as one: a plain np.memmap for one file, else ShardedTokens."""
    arrays = [np.memmap(Path(directory) / f[key], dtype=dtype, mode="r") for f in files]
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)
