"""Writing a checkpoint: each file hashed as it is written, never read back to hash it."""

import hashlib

import torch

from pretrainer.artifacts import checkpoint


def test_a_checkpoint_is_hashed_while_written_not_read_back(tmp_path, monkeypatch):
    hashed_by_reading = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(
        checkpoint, "sha256_file", lambda path, *a: hashed_by_reading.append(path.name) or real(path, *a)
    )
    weights = {"w": torch.randn(64, 32), "b": torch.arange(7.0)}
    optimizer = {
        "state": {"w": {"exp_avg": torch.randn(64, 32), "step": torch.tensor(3.0)}},
        "param_groups": [],
    }
    path = checkpoint.save_checkpoint(tmp_path, 5, weights, optimizer, {"step": 5}, keep=2)
    assert hashed_by_reading == ["state.json"]  # a few KB; the weights and moments: hashed as written
    complete = checkpoint.json.loads((path / checkpoint.MARKER).read_text())["files"]
    for name in checkpoint.FILES:
        data = (path / name).read_bytes()
        assert complete[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    loaded_weights, loaded_optimizer, state = checkpoint.load_checkpoint(path)
    assert all(torch.equal(loaded_weights[k], weights[k]) for k in weights) and state["step"] == 5
    assert torch.equal(loaded_optimizer["state"]["w"]["exp_avg"], optimizer["state"]["w"]["exp_avg"])
