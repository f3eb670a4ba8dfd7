from collections import Counter

import numpy as np
import pytest
import torch

from pretrainer.core.errors import UserError
from pretrainer.data.loader import SequenceLoader, TokenSource, validation_batches

TOKENS = np.arange(10_001, dtype=np.uint16) % 5000  # 10,001 tokens -> 1000 windows of 10 (+1)


def ids_of(loader: SequenceLoader, steps: int) -> list[list[list[int]]]:
    out = []
    for _ in range(steps):
        out.append(loader.step_sequence_ids())
        loader.next_step()
    return out


def test_windows_are_inputs_and_shifted_targets():
    loader = SequenceLoader(TOKENS, seq_len=10, micro_batch=4, grad_accum=1, seed=0)
    [(x, y)] = loader.next_step()
    assert x.shape == (4, 10) and y.shape == (4, 10)
    assert (y[:, :-1] == x[:, 1:]).all() and (x[:, 0] % 10 == 0).all()


def test_every_window_once_per_epoch_and_order_depends_on_seed():
    loader = SequenceLoader(TOKENS, seq_len=10, micro_batch=10, grad_accum=2, seed=1)
    seen = [i for step in ids_of(loader, 50) for micro in step for i in micro]
    assert sorted(seen) == list(range(1000))
    assert seen != sorted(seen)
    second = SequenceLoader(TOKENS, seq_len=10, micro_batch=10, grad_accum=2, seed=2)
    assert [i for step in ids_of(second, 50) for m in step for i in m] != seen
    # epoch 2
    assert Counter(i for step in ids_of(loader, 50) for m in step for i in m) == Counter(range(1000))


def test_resume_from_state_continues_the_stream_exactly():
    straight = SequenceLoader(TOKENS, seq_len=10, micro_batch=8, grad_accum=3, seed=5)
    expected = ids_of(straight, 90)  # crosses the epoch boundary at ~41.7 steps
    first = SequenceLoader(TOKENS, seq_len=10, micro_batch=8, grad_accum=3, seed=5)
    part = ids_of(first, 37)
    resumed = SequenceLoader(TOKENS, seq_len=10, micro_batch=8, grad_accum=3, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert part + ids_of(resumed, 53) == expected


def test_two_ranks_read_what_one_process_with_grad_accum_reads():
    single = SequenceLoader(TOKENS, seq_len=10, micro_batch=4, grad_accum=2, world_size=1, rank=0, seed=9)
    ranks = [
        SequenceLoader(TOKENS, seq_len=10, micro_batch=4, grad_accum=1, world_size=2, rank=r, seed=9)
        for r in (0, 1)
    ]
    for _ in range(30):
        one = single.step_sequence_ids()
        two = [r.step_sequence_ids()[0] for r in ranks]
        assert one == two
        for loader in (single, *ranks):
            loader.next_step()


def test_mismatched_state_is_refused_and_small_data_is_an_error():
    loader = SequenceLoader(TOKENS, seq_len=10, micro_batch=4, grad_accum=1, seed=0)
    for step in range(3):
        loader.next_step()
    reseeded = SequenceLoader(TOKENS, seq_len=10, micro_batch=4, grad_accum=1, seed=1)
    with pytest.raises(UserError, match="resume with the same data dir"):
        reseeded.load_state_dict(loader.state_dict())
    # a longer context (context extension) takes the position in tokens; a shorter one is refused
    longer = SequenceLoader(TOKENS, seq_len=20, micro_batch=2, grad_accum=1, seed=0)
    longer.load_state_dict(loader.state_dict())
    assert longer.cursor * 20 == loader.cursor * 10
    with pytest.raises(UserError, match="resume with the same data dir"):
        loader.load_state_dict(longer.state_dict())
    with pytest.raises(UserError, match="fewer than one step needs"):
        SequenceLoader(TOKENS[:100], seq_len=10, micro_batch=8, grad_accum=2)
    # world size larger than the data
    with pytest.raises(UserError, match=r"fewer than one step needs \(2 x 1 x 8 ranks\)"):
        SequenceLoader(TOKENS[:100], seq_len=10, micro_batch=2, grad_accum=1, world_size=8, rank=3)


def test_validation_batches_are_fixed_and_in_order():
    batches = validation_batches(TOKENS, seq_len=10, micro_batch=4, n_batches=3)
    assert len(batches) == 3 and batches[0][0][0, 0] == 0 and batches[2][0][-1, 0] == 110
    with pytest.raises(UserError, match="shorter than one sequence"):
        validation_batches(TOKENS[:5], seq_len=10, micro_batch=4, n_batches=3)


def test_sampled_verification_checks_eight_chunks_per_file_and_full_finds_any_change(
    jsonl_corpus, tmp_path, monkeypatch
):
    import hashlib

    from pretrainer.data.data_dir import open_data_dir
    from pretrainer.data.prepare import prepare
    from pretrainer.data.sources import Corpus
    from pretrainer.data.verify import verify_data

    monkeypatch.setattr("pretrainer.core.files.CHUNK_BYTES", 512)  # many chunks in a small file
    out = tmp_path / "data"
    prepare(Corpus([str(jsonl_corpus)]), "bpe:300", out, val_fraction=0.1, workers=1)
    data = open_data_dir(out)
    info = data.manifest["splits"]["train"]["shards"][0]
    raw = (out / "train-00000.bin").read_bytes()
    assert info["chunk_sha256"] == [
        hashlib.sha256(raw[i : i + 512]).hexdigest() for i in range(0, len(raw), 512)
    ]
    chunks = {
        name: len(split["shards"][0]["chunk_sha256"]) for name, split in data.manifest["splits"].items()
    }
    assert chunks["train"] > 8
    sampled = verify_data(data, "sampled")
    assert sampled["chunks"] == sum(chunks.values())
    assert sampled["chunks_checked"] == 8 + min(8, chunks["val"])
    assert verify_data(data, "off")["chunks_checked"] == 0
    middle = len(raw) // 2
    with open(out / "train-00000.bin", "r+b") as f:
        f.seek(middle)
        f.write(bytes([raw[middle] ^ 1]))  # one bit of one token
    start = middle // 512 * 512
    with pytest.raises(
        UserError, match=rf"train-00000\.bin: bytes {start:,}-{start + 512:,} differ from the checksum"
    ):
        verify_data(data, "full")


def test_prefetching_reads_the_same_batches_and_follows_a_moved_cursor(tmp_path):
    """The next step is read in a background thread (from a memmap, warmed with pread) while this one
    trains: the batches are the ones a plain loader reads, across an epoch boundary, with document
    packing (every rank's windows are read to count targets), and after the cursor is moved under it (a
    rollback skipping steps) the prefetched step is not used."""
    path = tmp_path / "train.bin"
    tokens = np.arange(20_000, dtype=np.uint16) % 997  # 996: the end-of-text of "documents" of 997 tokens
    tokens.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r")

    def make(prefetch: bool) -> SequenceLoader:
        source = TokenSource(mapped, 10, packing="document", eot_id=996)
        return SequenceLoader(
            source, 10, micro_batch=8, grad_accum=2, world_size=2, rank=1, seed=3, prefetch=prefetch
        )

    plain, ahead = make(False), make(True)
    for step in range(70):  # 1,999 windows, 32 per step: an epoch ends at step 62
        if step == 40:
            for loader in (plain, ahead):
                loader.cursor += 5 * loader.sequences_per_step
        expected, got = plain.next_step(), ahead.next_step()
        assert ahead._ahead is not None and ahead._ahead[0] == ahead.cursor  # the next step is being read
        assert all(torch.equal(a, b) for pair in zip(expected, got) for a, b in zip(*pair))
        assert plain.last_step_counts == ahead.last_step_counts and plain.last_step_ids == ahead.last_step_ids
    ahead.close()
    assert ahead._pool is None and not ahead.sources[0]._fds
