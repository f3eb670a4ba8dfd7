"""The training data's bytes against the checksums `prepare` recorded (data.verify), at each launch, so
a run's provenance (state.json) is what it read.

    data.verified = verify_data(data, "sampled")   # -> {"mode", "chunks_checked", "chunks", ...}
"""

from __future__ import annotations

from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.data.token_files import split_files

VERIFY_MODES = ("sampled", "full", "off")
SAMPLED_CHUNKS = 8  # data.verify = sampled: the first and last chunk of a split and 6 drawn at random


def verify_data(data, mode: str) -> dict:
    """The data's bytes against the checksums `prepare` recorded (data.verify): "full" hashes every byte,
    "sampled" SAMPLED_CHUNKS chunks of CHUNK_BYTES per split's token stream (and per mask stream: the first,
    the last and the rest drawn across all its shards; all of a small one), drawn afresh each launch so that
    restarts cover different parts; "off" nothing. A changed file is one line naming it and where it
    changed. -> what was checked, for state.json."""
    import random
    import time

    from pretrainer.core.files import CHUNK_BYTES, sha256_chunk, sha256_file

    started, checked, total, unchecked = time.perf_counter(), 0, 0, []
    draw = random.Random()  # not the run's seed: each launch looks somewhere else
    for part in data.parts if mode != "off" else []:
        for info in part.manifest["splits"].values():
            shards = split_files(info)
            streams = [[(s["file"], s["sha256"], s.get("chunk_sha256")) for s in shards]]
            if "mask_file" in shards[0]:
                streams.append(
                    [(s["mask_file"], s.get("mask_sha256"), s.get("mask_chunk_sha256")) for s in shards]
                )
            for files in streams:
                chunks = []  # (file, index in it, its sha256) over the stream's files
                for name, whole, digests in files:
                    file = part.path / name
                    if digests is None:  # prepared by an older version: whole-file hash only
                        small = file.stat().st_size <= SAMPLED_CHUNKS * CHUNK_BYTES
                        if whole and (mode == "full" or small):
                            if sha256_file(file) != whole:
                                raise _changed(file, "its sha256")
                            checked, total = checked + 1, total + 1
                        else:
                            unchecked.append(str(file))
                        continue
                    chunks += [(file, index, digest) for index, digest in enumerate(digests)]
                picks = range(len(chunks))
                if mode == "sampled" and len(chunks) > SAMPLED_CHUNKS:
                    middle = draw.sample(range(1, len(chunks) - 1), SAMPLED_CHUNKS - 2)
                    picks = sorted({0, len(chunks) - 1, *middle})
                for pick in picks:
                    file, index, digest = chunks[pick]
                    if sha256_chunk(file, index) != digest:
                        start = index * CHUNK_BYTES
                        end = min(start + CHUNK_BYTES, file.stat().st_size)
                        raise _changed(file, f"bytes {start:,}-{end:,}")
                checked, total = checked + len(picks), total + len(chunks)
    return {
        "mode": mode,
        "chunks_checked": checked,
        "chunks": total,
        "unchecked_files": unchecked,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _changed(file: Path, where: str) -> UserError:
    return UserError(
        f"{file}: {where} differ from the checksum manifest.json records: the data was changed after "
        f"`pretrainer prepare`; restore it or re-run prepare (data.verify = off skips this check)"
    )
