"""Spike drills on CPU: a tiny model on the real stdlib corpus, injected failures, detection,
classification, recovery and the written post-mortem."""

import os

import numpy as np
import pytest
import torch

from pretrainer.config.schema import ModelConfig, OptimConfig
from pretrainer.data.unigram import unigram_cache_path, unigram_counts
from pretrainer.model import Transformer
from pretrainer.optim.registry import build_optimizer
from pretrainer.train.spike_monitor import SpikeMonitor


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_nonfinite_gradients_never_reach_the_weights(name):
    """The loop's mechanism: the device-side monitor flags non-finite values, and fused AdamW's found_inf
    (or Muon's masks, reading the same flag on the device) drops the update."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2))
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=0.1), "cpu")
    monitor = SpikeMonitor(window=8, min_values=4, sigmas=6, device=torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    loss.backward()
    for p in model.parameters():
        p.grad[...] = float("nan")
    flags = monitor.update(loss.detach(), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    assert bool(flags.nonfinite) and bool(flags.spike)
    optimizer.found_inf = flags.nonfinite.float()
    optimizer.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for state in optimizer.state.values():  # no step counted, no moment or momentum gathered
        assert int(state.get("step", 0)) == 0
        assert all(not t.any() for key, t in state.items() if key != "step")


def test_monitor_flags_beyond_k_sigma_only_once_active():
    monitor = SpikeMonitor(window=16, min_values=8, sigmas=6, device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    flagged = []
    for i in range(40):
        loss = 5.0 + 0.05 * rng.standard_normal() + (10.0 if i in (3, 30) else 0.0)
        flagged.append(bool(monitor.update(torch.tensor(loss), torch.tensor(1.0)).spike))
    assert flagged[30] and not flagged[3]  # step 3: the window was not active yet
    assert sum(flagged) == 1


def test_unigram_counts_are_cached_outside_a_read_only_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAINER_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    np.array([0, 1, 1, 2, 2, 2], dtype=np.uint16).tofile(data / "train.bin")
    data.chmod(0o555)  # read-only (root writes anyway: hence the listing check)
    try:
        tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r")
        assert unigram_counts(tokens, 4, "sha-a").tolist() == [1, 2, 3, 0]
    finally:
        data.chmod(0o755)
    assert os.listdir(data) == ["train.bin"]
    assert unigram_cache_path("sha-a", 4).is_file()
    assert unigram_counts(np.zeros(5, dtype=np.uint16), 4, "sha-a").tolist() == [1, 2, 3, 0]  # from the cache


def test_an_unwritable_cache_only_means_counting_again(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("PRETRAINER_CACHE", str(tmp_path / "file" / "cache"))
    for _ in range(2):
        assert unigram_counts(np.array([3, 3, 0], dtype=np.uint16), 4, "sha-b").tolist() == [1, 0, 0, 2]
