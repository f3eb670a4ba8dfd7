"""The one ownership rule (core/ownership.py) every replacing writer passes, fed what it must refuse:
a checkpoint's file, a run dir, a data dir with a run inside, a symlink, another tool's files."""

import json

import pytest
import torch
from safetensors.torch import save_file

from pretrainer.artifacts.checkpoint import save_checkpoint
from pretrainer.artifacts.run_lock import RunDirLock
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_directory
from pretrainer.core.ownership import FILE_MARKER_KEY, check_replaceable, mark_output, owned, remove_output
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus


@pytest.fixture
def data_dir(tmp_path, jsonl_corpus):
    out = tmp_path / "data"
    prepare(Corpus([str(jsonl_corpus)]), "bpe:260", out, val_fraction=0.2, workers=1)
    return out


def a_run(run_dir):
    lock = RunDirLock(run_dir)
    lock.acquire()
    lock.close()
    weights = {"w": torch.zeros(2, 2)}
    return save_checkpoint(run_dir, 3, weights, {}, {"step": 3}, keep=1)


def test_a_checkpoint_s_files_and_anything_inside_checkpoints_are_refused(tmp_path):
    checkpoint = a_run(tmp_path / "run")
    for target, kind in [
        (checkpoint / "model.safetensors", "safetensors"),  # the file the adversary overwrote
        (checkpoint / "new.gguf", "gguf"),  # not even a new file inside one
        (tmp_path / "run" / "checkpoints" / "step-0000009", "hf"),  # would look like a checkpoint
    ]:
        with pytest.raises(UserError, match="is inside the check"):
            check_replaceable(target, kind)
    with pytest.raises(UserError, match="is not a report pretrainer wrote"):
        check_replaceable(tmp_path / "run", "report")  # a run dir is no one's output


def test_a_data_dir_holding_a_run_is_never_replaced_and_nothing_is_written_inside_one(tmp_path, data_dir):
    check_replaceable(data_dir, "data")  # prepare's own output: --force may replace it
    a_run(data_dir / "myrun")
    with pytest.raises(UserError, match=r"holds the run dir .*myrun"):
        check_replaceable(data_dir, "data")
    with pytest.raises(UserError, match="is inside the data dir"):
        check_replaceable(data_dir / "model.safetensors", "safetensors")
    with pytest.raises(UserError, match="is not a Hugging Face export"):
        check_replaceable(data_dir, "hf")


def test_symlinks_are_never_written_through(tmp_path, data_dir):
    link = tmp_path / "link"
    link.symlink_to(data_dir)
    with pytest.raises(UserError, match="is a symbolic link"):
        check_replaceable(link, "data")
    with pytest.raises(UserError, match="is a symbolic link"):
        remove_output(link, "data")
    assert owned(data_dir, "data") and not owned(link, "data") and link.resolve() == data_dir


def test_another_tool_s_files_are_refused_by_their_marker_not_their_name(tmp_path):
    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.zeros(2)}, theirs, metadata={"format": "pt"})
    hf_dir = tmp_path / "downloaded-model"
    hf_dir.mkdir()
    save_file({"w": torch.zeros(2)}, hf_dir / "model.safetensors")
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    gguf_like = tmp_path / "other.gguf"
    gguf_like.write_bytes(b"GGUF" + bytes(60))  # the magic number alone proves nothing
    for target, kind in [(theirs, "safetensors"), (hf_dir, "hf"), (gguf_like, "gguf")]:
        with pytest.raises(UserError, match="pretrainer wrote"):
            check_replaceable(target, kind)
    ours = tmp_path / "ours.safetensors"
    save_file({"w": torch.zeros(2)}, ours, metadata={FILE_MARKER_KEY: "safetensors"})
    check_replaceable(ours, "safetensors")
    with pytest.raises(UserError, match="is not a GGUF export"):
        check_replaceable(ours, "gguf")  # marked, but as another kind


def test_inputs_the_working_directory_and_their_parents_are_refused(tmp_path, monkeypatch):
    report = tmp_path / "out" / "report"
    report.mkdir(parents=True)
    mark_output(report, "report")
    check_replaceable(report, "report")
    with pytest.raises(UserError, match="which this command uses"):
        check_replaceable(report, "report", keep=[report])
    with pytest.raises(UserError, match="which it holds"):
        check_replaceable(tmp_path / "out", "report", keep=[report / "x"])
    monkeypatch.chdir(report)
    with pytest.raises(UserError, match="which this command uses"):
        check_replaceable(report, "report")


def test_a_stop_signal_right_after_the_temp_dir_is_made_leaves_none(tmp_path, monkeypatch):
    """SIGTERM mid-prepare left `.data.tmp-PID` when its exception (prepare's stop) came between the temp
    dir's mkdir and the block that removes it on failure: the signal is delivered here as that exception,
    raised the moment mkdir returns."""
    import pathlib

    made = pathlib.Path.mkdir

    def mkdir_then_stopped(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if ".tmp-" in self.name:
            raise KeyboardInterrupt  # what a signal handler raises between two bytecodes

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(tmp_path / "data", kind="data"):
            pass
    assert not list(tmp_path.iterdir())


def test_a_directory_output_is_marked_and_an_unforced_writer_never_replaces_a_racing_one(tmp_path):
    out = tmp_path / "data"
    with pytest.raises(UserError, match="another process wrote it while"):
        with atomic_directory(out, kind="data", replace=False) as tmp:
            (tmp / "mine").write_text("1")
            out.mkdir()  # a twin process finished first
            (out / "theirs").write_text("2")
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert not list(tmp_path.glob(".data.tmp-*"))
    with atomic_directory(tmp_path / "report", kind="report") as tmp:
        (tmp / "index.html").write_text("")
    assert owned(tmp_path / "report", "report") and not owned(tmp_path / "report", "data")


def _old_copy_removal_interrupted(monkeypatch, interrupt) -> None:
    """shutil.rmtree on the replaced copy removes one file, then `interrupt()` (a signal's exception, or
    the process killed): the moment a stop lands while an old output is being deleted."""
    import shutil

    remove = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if ".old-" in str(path):
            next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
            interrupt()
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def _output(out, text: str) -> None:
    with atomic_directory(out, kind="data") as tmp:
        for name in "abcde":
            (tmp / name).write_text(text)


@pytest.mark.parametrize("interrupt", ["stop", "kill -9"])
def test_a_stop_or_kill_while_the_old_output_is_removed_leaves_one_whole_copy(
    interrupt, tmp_path, monkeypatch
):
    """Replacing an output: the old copy was deleted before the new one took its place, so a SIGTERM then
    (prepare's stop, an exception) removed the new one too and left nothing, and a kill -9 left the half-
    deleted old copy for the next writer to put back as the output. Now `out` is whole at every moment."""
    import os
    import signal

    out = tmp_path / "data"
    _output(out, "old")
    if interrupt == "stop":

        def stop():
            raise KeyboardInterrupt  # what a signal handler raises between two bytecodes

        _old_copy_removal_interrupted(monkeypatch, stop)
        with pytest.raises(KeyboardInterrupt):
            _output(out, "new")
    else:
        pid = os.fork()
        if pid == 0:  # the writer, killed mid-removal
            _old_copy_removal_interrupted(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGKILL))
            try:
                _output(out, "new")
            finally:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL
        with pytest.raises(UserError, match="wrote it while"):  # the next writer's recovery, then a refusal
            with atomic_directory(out, kind="data", replace=False):
                pass
    assert {p.name: p.read_text() for p in out.iterdir() if not p.name.startswith(".")} == dict.fromkeys(
        "abcde", "new"
    )
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "data")
    # no temp dir; after the stop, the rest of the old copy, which the next writer removes
    assert left == ([f".data.old-{os.getpid()}"] if interrupt == "stop" else [])
    monkeypatch.undo()
    _output(out, "newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert (out / "a").read_text() == "newer"
