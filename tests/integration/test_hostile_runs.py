"""What a careless user, a double-submitting scheduler or a full disk does to a run: each case ends in
one line (exit 2) or the right behaviour, and nothing already saved is lost."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DOCS, exit_hook, exit_hook_calls, fork_cli, losses, tiny_overrides


@pytest.mark.parametrize("shape", [{"model.d_model": 1_000_000}, {"model.seq_len": 100_000_000}])
def test_a_shape_that_cannot_fit_is_refused_before_allocation(stdlib_data, tmp_path, run_cli, shape):
    run = tmp_path / "run"
    code, out, err = run_cli("train", *tiny_overrides(stdlib_data, run, **shape))
    assert code == 2, out + err
    assert err.count("\n") == 1 and err.startswith("error: config: this run needs about"), err
    assert "`pretrainer plan` itemises it" in err
    assert not run.exists(), "a run refused before its first write leaves nothing"


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run dir by relative path -> bytes, but the lock and the exit record (which
    says how the latest launch ended)."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name not in (".lock", "exit.json")
    }


def test_a_checkpoint_of_another_run_never_rewrites_a_run_and_may_start_a_branch(
    stdlib_data, tmp_path, run_cli
):
    first, other, branch = tmp_path / "first", tmp_path / "other", tmp_path / "branch"
    short = {"train.max_steps": 20, "eval.every": 10}
    assert run_cli("train", *tiny_overrides(stdlib_data, first, **short))[0] == 0
    assert run_cli("train", *tiny_overrides(stdlib_data, other, **short, **{"model.d_model": 32}))[0] == 0
    before = snapshot(other)
    foreign = first / "checkpoints" / "step-0000010"
    for extra in ([], ["--model.d_model=64"]):  # the saved config, or the foreign shape typed again
        code, out, err = run_cli("train", f"--run.dir={other}", f"--train.resume={foreign}", *extra)
        assert code == 2 and err.count("\n") == 1, out + err
        assert "holds a run of its own" in err and "give a new --run.dir" in err
        assert snapshot(other) == before, "the refused launch changed nothing in the run it was pointed at"
        assert json.loads((other / "exit.json").read_text())["reason"] == "finished"  # the run's own end
    # the run dir again, another model typed: refused, and the run's own exit record stays
    code, out, err = run_cli("train", *tiny_overrides(stdlib_data, other, **short, **{"model.d_model": 64}))
    assert code == 2 and "was trained with model.d_model = 32" in err, out + err
    assert json.loads((other / "exit.json").read_text())["reason"] == "finished"
    # the run's own checkpoint from a backup copy (the same config): accepted, and it continues exactly
    backup = shutil.copytree(other / "checkpoints" / "step-0000010", tmp_path / "backup" / "step-0000010")
    expected = losses(other)
    assert run_cli("train", f"--run.dir={other}", f"--train.resume={backup}")[0] == 0
    assert losses(other) == expected
    # a new run dir: the first run continued from its step 10, the same losses as the first run's own
    code, out, err = run_cli("train", f"--run.dir={branch}", f"--train.resume={foreign}")
    assert code == 0, out + err
    assert losses(branch) == {s: v for s, v in losses(first).items() if s > 10}


def test_another_run_s_checkpoint_brings_no_shell_command(stdlib_data, tmp_path, run_cli):
    """A shared or downloaded checkpoint continued in a new run dir: its run.on_exit is not taken (it
    would run a stranger's command, with this environment); its own command line's is."""
    theirs, mine, hook = tmp_path / "theirs", tmp_path / "mine", tmp_path / "hook"
    short = {"train.max_steps": 10, "eval.every": 10, "run.on_exit": exit_hook(hook)}
    assert run_cli("train", *tiny_overrides(stdlib_data, theirs, **short))[0] == 0
    assert [call[0] for call in exit_hook_calls(hook)] == ["finished"]
    checkpoint = theirs / "checkpoints" / "step-0000010"
    branch = [f"--run.dir={mine}", f"--train.resume={checkpoint}", "--train.max_steps=12"]
    code, out, err = run_cli("train", *branch)
    assert code == 0 and f"note: not inherited from {checkpoint}: run.on_exit" in out, out + err
    assert len(exit_hook_calls(hook)) == 1, "the other run's hook did not run again"
    assert 'on_exit = ""' in (mine / "config.toml").read_text()
    mine_too = tmp_path / "mine-too"
    own = [f"--run.dir={mine_too}", f"--train.resume={checkpoint}", f"--run.on_exit={exit_hook(hook)}"]
    code, out, err = run_cli("train", *own, "--train.max_steps=12")
    assert code == 0 and "not inherited" not in out, out + err
    assert exit_hook_calls(hook)[-1] == ("finished", 0, 12, str(mine_too))  # given by this launch: runs


def test_a_run_dir_with_a_space_resumes_with_the_command_it_prints(stdlib_data, tmp_path, run_cli):
    run = tmp_path / "my run"
    code, out, err = run_cli(
        "train", *tiny_overrides(stdlib_data, run, **{"train.max_steps": 20}), "--train.stop_at_step=10"
    )
    assert code == 0, out + err
    printed = next(
        line.strip() for line in out.splitlines() if line.strip().startswith("pretrainer train --run.dir")
    )
    argv = shlex.split(printed.split("#")[0])
    assert argv[:2] == ["pretrainer", "train"] and argv[2] == f"--run.dir={run}"
    code, out, err = run_cli(*argv[1:])
    assert code == 0, out + err
    assert max(losses(run)) == 20 and "resuming from" in out


@pytest.fixture(scope="module")
def small_run(stdlib_data, tmp_path_factory) -> Path:
    """A finished 10-step run, only read by the tests that use it."""
    from helpers import tiny_config

    from pretrainer.train.loop import train

    run = tmp_path_factory.mktemp("small") / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 10, "eval.every": 10}))
    return run


def test_force_replaces_only_what_pretrainer_made(small_run, tmp_path, run_cli, jsonl_corpus):
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("four years")
    before = snapshot(small_run)
    for out, why in [
        (small_run, "itself"),
        (small_run.parent, "which it holds"),
        (thesis, "is not a report pretrainer wrote"),
    ]:
        code, out_text, err = run_cli("export", small_run, "--out", out, "--force")
        assert code == 2 and err.count("\n") == 1 and why in err, err
    assert snapshot(small_run) == before and (thesis / "thesis.tex").read_text() == "four years"
    report = tmp_path / "report"
    for _ in range(2):  # its own report: replaced
        assert run_cli("export", small_run, "--out", report, "--force")[0] == 0
    code, _, err = run_cli("export", small_run, "--format", "hf", "--out", report, "--force")
    assert code == 2 and "is not a Hugging Face export" in err  # a report is not an hf export
    prepare = ["prepare", "--corpus", jsonl_corpus, "--tokenizer", "bpe:300", "--val-fraction", "0.1"]
    code, _, err = run_cli(*prepare, "--out", thesis, "--force")
    assert code == 2 and "is not a prepared data dir pretrainer wrote" in err
    code, _, err = run_cli(*prepare, "--out", jsonl_corpus.parent, "--force")
    assert code == 2 and "which it holds" in err  # the corpus lives there
    assert (thesis / "thesis.tex").read_text() == "four years" and jsonl_corpus.is_file()
    data = tmp_path / "data"
    for _ in range(2):  # its own prepared data: replaced
        assert run_cli(*prepare, "--out", data, "--force")[0] == 0


def test_eval_out_is_checked_before_the_evaluation(small_run, tmp_path, run_cli):
    code, out, err = run_cli("eval", small_run, "--tasks", "none", "--out", tmp_path)
    assert code == 2 and err == f"error: {tmp_path}: is a directory; give a file path for --out\n"
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = run_cli("eval", small_run, "--tasks", "none", "--out", blocker / "sub" / "e.json")
    assert code == 2 and "is a file, not a directory" in err
    code, out, err = run_cli("export", small_run, "--format", "hf", "--out", blocker / "hf")
    assert code == 2 and "is a file, not a directory" in err and not (small_run / "hf").exists()
    target = tmp_path / "new" / "dir" / "e.json"
    assert run_cli("eval", small_run, "--tasks", "none", "--out", target)[0] == 0
    assert json.loads(target.read_text())["val_loss"] > 0
    assert sorted(p.name for p in target.parent.iterdir()) == ["e.json"], "no temp file left"


@pytest.fixture
def data_copy(stdlib_data, tmp_path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(stdlib_data, copy)
    return copy


def test_edited_data_is_refused_at_launch_and_state_says_what_was_verified(data_copy, tmp_path, run_cli):
    short = {"train.max_steps": 2, "eval.every": 0, "ckpt.every": 0}
    run = tmp_path / "run"
    assert run_cli("train", *tiny_overrides(data_copy, run, **short))[0] == 0
    state = json.loads(next((run / "checkpoints").glob("step-*/state.json")).read_text())
    verified = state["dataset"]["verified"]
    assert verified["mode"] == "sampled" and verified["chunks_checked"] == verified["chunks"] > 0
    train_bin = (
        data_copy
        / json.loads((data_copy / "manifest.json").read_text())["splits"]["train"]["shards"][0]["file"]
    )
    tokens = np.memmap(train_bin, dtype=np.uint16, mode="r+")
    tokens[1000:3000] = tokens[5000:7000]  # same size, other ids: only the checksum can tell
    tokens.flush()
    code, out, err = run_cli("train", *tiny_overrides(data_copy, tmp_path / "again", **short))
    assert code == 2 and err.count("\n") == 1, out + err
    size = train_bin.stat().st_size  # a 16 MiB chunk is more than this small file
    assert err.startswith(f"error: {train_bin}: bytes 0-{size:,} differ from the checksum manifest.json")
    assert not (tmp_path / "again").exists()


def test_an_id_outside_the_vocabulary_in_val_is_one_line(data_copy, tmp_path, run_cli):
    val = np.memmap(data_copy / "val-00000.bin", dtype=np.uint16, mode="r+")
    val[10] = 1500  # the vocabulary is 1,024
    val.flush()
    short = {"train.max_steps": 2, "data.verify": "off"}  # past the checksum: the ids are checked too
    code, out, err = run_cli("train", *tiny_overrides(data_copy, tmp_path / "run", **short))
    assert code == 2 and err.count("\n") == 1, out + err
    assert "token id 1500 is outside the model's vocabulary (1024)" in err


def test_a_manifest_path_outside_the_data_dir_is_refused(data_copy, tmp_path, run_cli):
    (tmp_path / "outside.txt").write_bytes(b"\0" * 64)
    manifest = json.loads((data_copy / "manifest.json").read_text())
    manifest["splits"]["val"]["shards"][0]["file"] = "../outside.txt"
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli("train", *tiny_overrides(data_copy, tmp_path / "run"))
    assert code == 2 and "split file '../outside.txt' is not a file name inside" in err, out + err


SECRETS = ("S3CRET-PW", "S3CRET-TOKEN", "S3CRET-B", "S3CRET-SIG", "S3CRET-FRAG", "S3CRET-HOOK")
CREDENTIALS = [
    f"--mlflow.uri=http://alice:{SECRETS[0]}@127.0.0.1:9/?token={SECRETS[1]}",  # nothing listens: warned
    # a token as the user part alone, and one in a fragment
    f"--budget.file=https://{SECRETS[2]}@example.invalid/budget.json?sig={SECRETS[3]}#{SECRETS[4]}",
    "--budget.cap_usd=100",
    "--budget.usd_per_gpu_hour=1",
    f"--run.on_exit=curl -s https://hooks.invalid/services/{SECRETS[5]} || true",  # a shell command
]


def assert_no_secret(root: Path, *texts: str) -> None:
    files = [p for p in root.rglob("*") if p.is_file()]
    found = [str(p) for p in files if any(s.encode() in p.read_bytes() for s in SECRETS)]
    found += [f"output {i}" for i, text in enumerate(texts) if any(s in text for s in SECRETS)]
    assert not found, f"a secret reached {found}"
    assert len(files) > 20


def test_credentials_in_uris_reach_no_file_log_or_tracker(
    small_run, stdlib_data, tmp_path, run_cli, monkeypatch
):
    import time

    run, outputs = tmp_path / "run", []
    settings = tiny_overrides(
        stdlib_data, run, **{"train.max_steps": 10, "eval.every": 10, "track.backends": "mlflow"}
    )
    for extra in (["--train.stop_at_step=5"], []):  # a stop and a resume, the credentials given again
        started = time.monotonic()
        code, out, err = run_cli("train", *settings, *CREDENTIALS, *extra)
        assert code == 0, out + err
        assert err.count("warning: mlflow failed") + out.count("warning: mlflow failed") == 1
        # the closed port is found at once (mlflow's own 7 retries with backoff took 257 s)
        assert "cannot connect to 127.0.0.1:9" in out + err and time.monotonic() - started < 60
        outputs += [out, err]
    assert losses(run) == losses(small_run), "tracking that failed changed nothing in training"
    saved = (run / "config.toml").read_text()
    assert "alice:***@127.0.0.1:9/?token=***" in saved and 'on_exit = "***"' in saved, saved
    code, out, err = run_cli("train", f"--run.dir={run}", "--train.max_steps=12")  # resumed from config.toml
    note = next(line for line in out.splitlines() if line.startswith(f"note: not inherited from {run}/"))
    assert code == 0 and all(key in note for key in ("track.mlflow_uri", "budget.file", "run.on_exit")), out
    outputs += [out, err]
    for argv in (["export", run, "--format", "report"], ["export", run, "--format", "hf"]):
        code, out, err = run_cli(*argv)
        assert code == 0, out + err
        outputs += [out, err]
    code, out, err = run_cli("push", run, "me/x", "--dry-run")  # the Hub card it stages
    assert code == 0 and (run / ".hub-push" / "README.md").is_file(), out + err
    outputs += [out, err]
    # trackers that work: mlflow's params and artifacts in mlflow.db, W&B's offline run (W&B records the
    # process's command line unless told not to: here it holds the credentials, as a CLI process's would)
    tracked = tmp_path / "tracked"
    backends = {"train.max_steps": 3, "track.backends": "mlflow,wandb,tensorboard"}
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr("sys.argv", ["pretrainer", "train", *CREDENTIALS[1:]])
    code, out, err = run_cli("train", *tiny_overrides(stdlib_data, tracked, **backends), *CREDENTIALS[1:])
    assert code == 0 and (tracked / "mlflow.db").is_file(), out + err
    assert "warning: mlflow" not in out + err and "warning: wandb" not in out + err, out + err
    assert any((tracked / "wandb").glob("offline-run-*/run-*.wandb"))
    assert any((tracked / "tensorboard").glob("events.out.tfevents.*")) and "warning: tensorboard" not in err
    assert_no_secret(tmp_path, *outputs, out, err)


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_broken_tracking_store_is_one_warning_and_training_continues(
    small_run, stdlib_data, tmp_path, run_cli, damage
):
    run = tmp_path / "run"
    settings = tiny_overrides(
        stdlib_data, run, **{"train.max_steps": 10, "eval.every": 10, "track.backends": "mlflow"}
    )
    assert run_cli("train", *settings, "--train.stop_at_step=5")[0] == 0
    store = run / "mlflow.db"
    if damage == "garbage":
        store.write_bytes(b"not a database " * 100)
    else:
        store.unlink()
    code, out, err = run_cli("train", *settings)
    assert code == 0, out + err
    assert (out + err).count("warning: mlflow failed") == 1 and "Traceback" not in out + err
    assert losses(run) == losses(small_run)


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int, read_only: bool = False):
    """A real filesystem of `size_bytes` (tmpfs) at `path`: writes past it fail with ENOSPC as on a full
    disk. Needs root, which CI and these machines have."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_mid_run_is_one_line_and_loses_no_checkpoint(stdlib_data, tmp_path, run_cli):
    from pretrainer.artifacts.checkpoint import list_checkpoints, verify_checkpoint

    settings = {"train.max_steps": 20, "ckpt.every": 5, "eval.every": 10}
    reference = tmp_path / "reference"
    assert run_cli("train", *tiny_overrides(stdlib_data, reference, **settings))[0] == 0
    checkpoint_bytes = sum(f.stat().st_size for f in list_checkpoints(reference)[-1].iterdir())
    other_bytes = sum(
        f.stat().st_size for f in reference.rglob("*") if f.is_file() and "checkpoints" not in str(f)
    )
    room = other_bytes + int(2.5 * checkpoint_bytes) + 64 * 4096  # two checkpoints fit, the third does not
    with small_disk(tmp_path / "disk", room) as disk:
        run = disk / "run"
        code, out, err = run_cli("train", *tiny_overrides(stdlib_data, run, **settings))
        assert code == 7, out + err
        step_15 = f"{run}/checkpoints/step-0000015"
        assert err.count("\n") == 1 and err.startswith(
            f"error: {step_15}: cannot write the checkpoint at step 15: no space left on the device (it needs"
        ), err
        kept = list_checkpoints(run)
        assert [p.name for p in kept] == ["step-0000005", "step-0000010"]
        assert all(verify_checkpoint(p) == "" for p in kept)
        assert not [p for p in run.rglob("*") if ".tmp-" in p.name], "no temp file or dir is left"
        record = json.loads((run / "exit.json").read_text())
        assert record["reason"] == "write_fault" and record["exit_code"] == 7
        moved = shutil.copytree(run, tmp_path / "moved")  # the user frees space: here, a bigger disk
    code, out, err = run_cli("train", f"--run.dir={moved}")
    assert code == 0, out + err
    assert losses(moved) == losses(reference), "the run continued bit-exactly from step 10"


def test_prepare_onto_a_full_disk_and_a_bad_run_dir_are_one_line(
    jsonl_corpus, stdlib_data, tmp_path, run_cli
):
    with small_disk(tmp_path / "disk", 4096) as disk:
        code, out, err = run_cli(
            "prepare", "--corpus", jsonl_corpus, "--tokenizer", "bpe:300", "--out", disk / "d"
        )
        assert code == 7 and err.count("\n") == 1 and "no space left on the device" in err, out + err
        assert list(disk.iterdir()) == [], "nothing half-written is left"
    with small_disk(tmp_path / "ro", 4096, read_only=True) as read_only:
        code, out, err = run_cli("train", *tiny_overrides(stdlib_data, read_only / "run"))
        assert code == 2 and err.count("\n") == 1 and "cannot be the run dir (Read-only file system)" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    code, out, err = run_cli("train", *tiny_overrides(stdlib_data, a_file))
    assert (
        code == 2 and err == f"error: {a_file}: cannot be the run dir (File exists); choose another run.dir\n"
    )


def test_sigterm_during_prepare_leaves_no_temp_and_a_killed_one_is_cleaned_next_time(
    stdlib_data, tmp_path, run_cli
):
    import signal
    import time

    out = tmp_path / "data"
    # the tokenizer reused, not trained: HF tokenizers' trainer can deadlock in a child forked after
    # this process used it
    prepare = [
        "prepare",
        "--corpus",
        "stdlib",
        "--tokenizer-from",
        stdlib_data,
        "--workers",
        "1",
        "--out",
        out,
    ]
    child = fork_cli(*prepare, log=tmp_path / "log")
    deadline = time.time() + 60
    while not list(tmp_path.glob(".data.tmp-*")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".data.tmp-*")), (tmp_path / "log").read_text()
    os.kill(child.pid, signal.SIGTERM)
    child.join(30)
    assert child.exitcode == 143, (tmp_path / "log").read_text()
    assert "stopped: SIGTERM: prepare: nothing was written" in (tmp_path / "log").read_text()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left in (["log"], ["data.prepare", "log"]), "the temp dir went with the process"
    if left != ["log"]:  # units were done: kept for the same command to continue from
        assert list((tmp_path / "data.prepare" / "units").glob("*.json"))
    killed = tmp_path / ".data.tmp-999999999"  # what kill -9 leaves: its process is gone
    (killed / "deep").mkdir(parents=True)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    code, stdout, err = run_cli(
        "prepare", "--corpus", corpus, "--tokenizer", "bpe:300", "--out", out, "--force"
    )
    assert code == 0 and not killed.exists(), stdout + err  # --force: the other command's units go


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sample", "RUN", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
        (["sample", "RUN", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        (["sample", "RUN", "--top-k", "-5"], "argument --top-k: must be an integer >= 0"),
        (["sample", "RUN", "--num-samples", "0"], "argument --num-samples: must be an integer >= 1"),
        (["sample", "RUN", "--device", "tpu"], "device 'tpu': not a device here"),
        (["plan", "--tokens", "nan"], "argument --tokens: must be a finite number > 0"),
        (["plan", "--tokens", "-5"], "argument --tokens: must be a finite number > 0"),
        (["plan", "--tokens", "1e400"], "argument --tokens: must be a finite number > 0"),
        (["plan", "--peak-tflops", "-1"], "argument --peak-tflops: must be a finite number > 0"),
        (
            ["serve-cost", "RUN", "--usd-per-hour", "inf"],
            "argument --usd-per-hour: must be a finite number >= 0",
        ),
    ],
)
def test_other_verbs_refuse_bad_values_in_one_line(small_run, capsys, argv, message):
    from pretrainer.cli.main import main

    argv = [str(small_run) if a == "RUN" else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's, now one line
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_checkpoint_a_reader_holds_outlives_rotation(stdlib_data, tmp_path, run_cli):
    from pretrainer.artifacts.checkpoint import list_checkpoints, pin_checkpoint, release_pins

    run = tmp_path / "run"
    settings = tiny_overrides(stdlib_data, run, **{"train.max_steps": 40, "eval.every": 0})
    assert run_cli("train", *settings, "--train.stop_at_step=20")[0] == 0
    read = list_checkpoints(run)[0]  # step 10: what eval or serve-cost is reading
    pin_checkpoint(read)
    try:
        assert run_cli("train", *settings, "--train.stop_at_step=30")[0] == 0
        assert [p.name for p in list_checkpoints(run)] == [read.name, "step-0000020", "step-0000030"]
    finally:
        release_pins()
    assert run_cli("train", *settings)[0] == 0
    assert [p.name for p in list_checkpoints(run)] == ["step-0000030", "step-0000040"], "then it goes"


def test_weights_of_another_shape_under_a_forged_checksum_are_refused(small_run, tmp_path, run_cli):
    from safetensors.torch import load_file, save_file

    from pretrainer.core.files import sha256_file

    run = shutil.copytree(small_run, tmp_path / "run")
    checkpoint = next((run / "checkpoints").iterdir())
    weights = {
        k: torch.zeros(v.shape[0] + 1, *v.shape[1:])
        for k, v in load_file(checkpoint / "model.safetensors").items()
    }
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["files"]["model.safetensors"] = {
        "bytes": (checkpoint / "model.safetensors").stat().st_size,
        "sha256": sha256_file(checkpoint / "model.safetensors"),
    }
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    for fmt in ("hf", "safetensors"):
        code, out, err = run_cli("export", run, "--format", fmt)
        assert code == 2 and err.count("\n") == 1 and "weights do not fit this model" in err, out + err
    assert not (run / "hf").exists() and not (run / "model.safetensors").exists()


def test_resuming_with_other_cpu_threads_says_it_is_not_bit_exact(stdlib_data, tmp_path, run_cli):
    run, threads = tmp_path / "run", torch.get_num_threads()
    settings = tiny_overrides(stdlib_data, run, **{"train.max_steps": 10, "eval.every": 0})
    torch.set_num_threads(threads + 1)
    try:
        assert run_cli("train", *settings, "--train.stop_at_step=5")[0] == 0
    finally:
        torch.set_num_threads(threads)
    code, out, err = run_cli("train", *settings)
    assert code == 0 and f"trained with {threads + 1} CPU threads and resumes with {threads}" in out + err
    assert f"OMP_NUM_THREADS={threads + 1}" in out + err
    code, out, err = run_cli("train", *settings, "--train.max_steps=12")  # the same threads: no warning
    assert code == 0 and "CPU threads" not in out + err
