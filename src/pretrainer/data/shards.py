"""The data dir's token files, joined from prepare's units (data/work_units.py) in corpus order: exact
duplicate documents dropped (the first occurrence wins, whichever unit, worker or part read it), at most
max_docs documents, and each split cut into shards of shard_tokens tokens:

    train-00000.bin, train-00001.bin, ...   (and train-00000.mask.bin, ... for chat data)

A shard ends at its token count, not at a document's end: the loader reads a split's shards as one
array (data/token_files.py). The manifest lists each shard with its sha256 and per-chunk sha256s, and the
split's sha256 is that of the whole stream (a single-file data dir's sha256 of the same tokens)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from pretrainer.core.files import ChunkedSha256, naming
from pretrainer.data.work_units import unit_path

SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per shard


class KeySet:
    """A set of 64-bit content keys in one numpy array (open addressing, at most half full): 8-16
    bytes per document, where a Python set of ints takes ~70."""

    def __init__(self, capacity: int = 1 << 16):
        self.slots, self.used, self.has_zero = np.zeros(capacity, dtype=np.uint64), 0, False

    def add(self, key: int) -> bool:
        """Insert; False when the key was already there."""
        if key == 0:  # 0 marks an empty slot, so the key 0 is kept aside
            new, self.has_zero = not self.has_zero, True
            return new
        key = np.uint64(key)
        mask = len(self.slots) - 1
        i = int(key) & mask
        while self.slots[i]:
            if self.slots[i] == key:
                return False
            i = (i + 1) & mask
        self.slots[i] = key
        self.used += 1
        if 2 * self.used > len(self.slots):
            old, self.slots, self.used = (
                self.slots[self.slots != 0],
                np.zeros(2 * len(self.slots), dtype=np.uint64),
                0,
            )
            for k in old.tolist():
                self.add(k)
        return True


class _ShardFile:
    def __init__(self, path: Path):
        self.path, self.file, self.sha, self.size = path, open(path, "wb"), ChunkedSha256(), 0

    def write(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as e:  # a full disk: say which file
            raise naming(e, self.path) from None
        self.sha.update(data)
        self.size += len(data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class SplitShards:
    """One split's shards (and masks), written as the tokens arrive."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, chat: bool, shard_tokens: int):
        self.directory, self.split, self.dtype, self.chat = directory, split, dtype, chat
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.current: list[_ShardFile] | None = None
        self.in_shard = 0
        self.whole, self.whole_mask = hashlib.sha256(), hashlib.sha256()
        self.documents = self.tokens = self.trained_tokens = 0

    def write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        start = 0
        while start < len(tokens):
            if self.current is None:
                name = f"{self.split}-{len(self.shards):05d}"
                self.current = [_ShardFile(self.directory / f"{name}.bin")]
                if self.chat:
                    self.current.append(_ShardFile(self.directory / f"{name}.mask.bin"))
            take = min(len(tokens) - start, self.shard_tokens - self.in_shard)
            data = np.ascontiguousarray(tokens[start : start + take], dtype=self.dtype).tobytes()
            self.current[0].write(data)
            self.whole.update(data)
            if self.chat:
                mask_bytes = np.ascontiguousarray(mask[start : start + take], dtype=np.uint8).tobytes()
                self.current[1].write(mask_bytes)
                self.whole_mask.update(mask_bytes)
                self.trained_tokens += int(mask[start : start + take].sum())
            self.in_shard += take
            self.tokens += take
            start += take
            if self.in_shard == self.shard_tokens:
                self._end_shard()

    def _end_shard(self) -> None:
        for f in self.current:
            f.close()
        tokens_file = self.current[0]
        shard = {
            "file": tokens_file.path.name,
            "tokens": self.in_shard,
            "sha256": tokens_file.sha.hexdigest(),
            "chunk_sha256": tokens_file.sha.chunk_digests(),
        }
        if self.chat:
            mask_file = self.current[1]
            shard.update(
                mask_file=mask_file.path.name,
                mask_sha256=mask_file.sha.hexdigest(),
                mask_chunk_sha256=mask_file.sha.chunk_digests(),
            )
        self.shards.append(shard)
        self.current, self.in_shard = None, 0

    def close(self) -> dict:
        if self.current is not None:
            self._end_shard()
        info = {
            "documents": self.documents,
            "tokens": self.tokens,
            "sha256": self.whole.hexdigest(),
            "shards": self.shards,
        }
        if self.chat:
            info.update(mask_sha256=self.whole_mask.hexdigest(), trained_tokens=self.trained_tokens)
        return info


def _mapped(path: Path, dtype) -> np.ndarray:
    """A unit's file, memory-mapped (read a run at a time as it is copied: memory stays flat)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class Assembly:
    """Units in, shards out (see the module docstring): add() each unit's record in unit order."""

    def __init__(
        self,
        directory: Path,
        units_dir: Path,
        dtype: np.dtype,
        *,
        chat: bool,
        shard_tokens: int,
        max_docs: int,
    ):
        self.units_dir, self.dtype, self.chat, self.max_docs = units_dir, dtype, chat, max_docs
        self.splits = {s: SplitShards(directory, s, dtype, chat, shard_tokens) for s in ("train", "val")}
        self.seen = KeySet()
        self.duplicates = self.kept = self.max_token = 0
        self.read_documents: dict[int, int] = {}  # per corpus file: documents read (duplicates too)
        self.full = False  # max_docs reached

    def add(self, record: dict) -> bool:
        """Append a unit's kept documents; False once max_docs documents are in (no more units needed)."""
        if self.full:
            return False
        index = record["unit"]
        table = np.load(unit_path(self.units_dir, index, "docs.npy"))
        keep = np.ones(len(table), dtype=bool)
        used = len(table)
        keys, dedup = table["key"].tolist(), table["dedup"].tolist()
        for i in range(len(table)):
            if dedup[i] and not self.seen.add(keys[i]):
                keep[i] = False
                self.duplicates += 1
                continue
            self.kept += 1
            if self.max_docs and self.kept >= self.max_docs:
                used, self.full = i + 1, True
                keep[used:] = False
                break
        for file, count in zip(*np.unique(table["file"][:used], return_counts=True)):
            self.read_documents[int(file)] = self.read_documents.get(int(file), 0) + int(count)
        for split, shards in self.splits.items():
            in_split = table["val"] == (split == "val")
            lengths = table["tokens"][in_split].astype(np.int64)
            kept = keep[in_split]
            if not len(lengths):
                continue
            tokens = _mapped(unit_path(self.units_dir, index, f"{split}.bin"), self.dtype)
            mask = (
                _mapped(unit_path(self.units_dir, index, f"{split}.mask.bin"), np.uint8)
                if self.chat
                else None
            )
            ends = np.cumsum(lengths)
            starts = ends - lengths
            edges = np.flatnonzero(np.diff(np.concatenate([[0], kept.astype(np.int8), [0]])))  # runs of kept
            for first, last in zip(edges[::2], edges[1::2]):
                a, b = int(starts[first]), int(ends[last - 1])
                shards.write(tokens[a:b], None if mask is None else mask[a:b])
                if b > a:
                    self.max_token = max(self.max_token, int(tokens[a:b].max()))
            shards.documents += int(kept.sum())
        return not self.full

    def close(self) -> dict:
        return {split: shards.close() for split, shards in self.splits.items()}
