"""`pretrainer push` then a pull of what it staged, through huggingface_hub's real cache layout: no Hub
runs here, so support/hub_cache.py stands for the upload and download in between (the docs say so)."""

import shutil

import pytest
import torch
from helpers import run_subprocess, tiny_config
from support.hub_cache import publish_to_hub_cache

from pretrainer.artifacts.runs import open_init_source, open_run
from pretrainer.core.errors import UserError
from pretrainer.data.hub import pull
from pretrainer.train.loop import train


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """This process's huggingface_hub reads only a cache the test fills (constants read at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_push_then_pull_a_data_dir_and_an_export_verifies_every_file(
    stdlib_data, tmp_path, run_cli, offline_hub
):
    data = tmp_path / "data"
    shutil.copytree(stdlib_data, data)
    code, out, err = run_cli("push", data, "me/stdlib-bpe1k", "--dry-run")
    assert code == 0 and "staged 9 files" in out and "dry run: nothing uploaded" in out, out + err
    staged = data / ".hub-push"
    card = (staged / "README.md").read_text()
    assert "--data.dir=hf://me/stdlib-bpe1k" in card and "| train |" in card
    snapshot = publish_to_hub_cache(staged, "me/stdlib-bpe1k", "dataset", offline_hub)

    # the real CLI in its own process: the env vars huggingface_hub reads, the pull and both verifications
    pulled = tmp_path / "pulled"
    result = run_subprocess(
        "prepare",
        "--from-hub",
        "me/stdlib-bpe1k",
        "--out",
        pulled,
        env={"HF_HUB_CACHE": str(offline_hub), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0 and "every file matches checksums.sha256" in result.stdout, result.stderr
    for name in ("train-00000.bin", "val-00000.bin", "manifest.json", "tokenizer.json"):
        assert (pulled / name).read_bytes() == (data / name).read_bytes()

    # a run trains on hf://; its saved config keeps the repo, not the cache path
    run = tmp_path / "run"
    train(tiny_config("hf://me/stdlib-bpe1k", run, **{"train.max_steps": 4, "eval.every": 4}))
    assert 'dir = "hf://me/stdlib-bpe1k"' in (run / "config.toml").read_text()
    code, out, err = run_cli("train", f"--run.dir={run}", "--train.max_steps=6")  # from its saved config
    assert code == 0 and "step 6/6" in out, out + err
    # --force replaces a prepared data dir only, never another directory
    code, out, err = run_cli("prepare", "--from-hub", "me/stdlib-bpe1k", "--out", run, "--force")
    assert (
        code == 2 and "is not a prepared data dir pretrainer wrote" in err and (run / "checkpoints").is_dir()
    )

    # the run as an export: pulled back, its weights are the run's (bf16)
    code, out, err = run_cli("push", run, "me/tiny", "--dry-run")
    assert code == 0, out + err
    publish_to_hub_cache(run / ".hub-push", "me/tiny", "model", offline_hub)
    source = open_init_source("hf://me/tiny")
    ours = open_run(run).load_weights()
    theirs = source.load()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k].to(torch.bfloat16).float()) for k in ours)

    # a pulled file changed in the cache is refused, naming it
    blob = (snapshot / "val-00000.bin").resolve()
    blob.write_bytes(blob.read_bytes()[:-2] + b"\x00\x01")
    with pytest.raises(UserError, match=r"val-00000\.bin does not match its sha256 in checksums\.sha256"):
        pull("hf://me/stdlib-bpe1k", "dataset")
    result = run_subprocess(
        "train",
        "configs/tiny-cpu.toml",
        "--data.dir=hf://me/stdlib-bpe1k",
        f"--run.dir={tmp_path / 'r2'}",
        env={"HF_HUB_CACHE": str(offline_hub), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2 and result.stderr.count("error:") == 1 and "val-00000.bin" in result.stderr
    assert "Traceback" not in result.stderr


def test_links_out_of_a_snapshot_or_a_data_dir_are_never_followed(
    stdlib_data, tmp_path, run_cli, offline_hub
):
    """A snapshot whose listed file links to a file outside the cache (its sha256 listed, so the
    checksums alone pass), or whose directory links elsewhere: the pull is refused in one line and
    copies nothing. A data dir holding a link out of it is not staged for a push."""
    import hashlib

    outside = tmp_path / "outside"
    (outside / "etc").mkdir(parents=True)
    (outside / "hostname").write_text("a machine's own file\n")
    data = shutil.copytree(stdlib_data, tmp_path / "data")
    assert run_cli("push", data, "me/d", "--dry-run")[0] == 0
    snapshot = publish_to_hub_cache(data / ".hub-push", "me/d", "dataset", offline_hub)
    listing = snapshot / "checksums.sha256"
    lines = listing.read_text()
    listing.unlink()  # a tampered listing, as a hostile repo would hold
    digest = hashlib.sha256((outside / "hostname").read_bytes()).hexdigest()
    listing.write_text(lines + f"{digest}  extra.txt\n")
    (snapshot / "extra.txt").symlink_to(outside / "hostname")
    pulled = tmp_path / "pulled"
    code, out, err = run_cli("prepare", "--from-hub", "me/d", "--out", pulled)
    assert code == 2 and err.count("\n") == 1 and "extra.txt links outside the repo's cache" in err, out + err
    assert not pulled.exists()
    (snapshot / "extra.txt").unlink()
    listing.write_text(lines)
    (snapshot / "sub").symlink_to(outside / "etc")
    code, out, err = run_cli("prepare", "--from-hub", "me/d", "--out", pulled)
    assert code == 2 and "sub links outside the repo's cache" in err and not pulled.exists(), out + err
    # the push side: a link out of the data dir is not staged (its file would go up with the data)
    (data / "notes.txt").symlink_to(outside / "hostname")
    code, out, err = run_cli("push", data, "me/d", "--dry-run")
    assert code == 2 and err.count("\n") == 1 and "notes.txt links outside the data dir" in err, out + err
