"""One trainer per run dir (artifacts/run_lock.py): the lock outlives its file, and a trainer whose run
dir was moved, or whose lock was taken, finds out before its next step."""

import os

import pytest

from pretrainer.artifacts.run_lock import LOCK_FILE, RunDirLock
from pretrainer.core.errors import UserError


def test_the_run_dir_lock_outlives_its_file_and_notices_a_moved_run_dir(tmp_path):
    run = tmp_path / "run"
    first = RunDirLock(run)
    first.acquire()
    (run / LOCK_FILE).unlink()
    with pytest.raises(UserError, match="in use by"):  # the directory's own lock
        RunDirLock(run).acquire()
    assert first.lost() is None and f"pid {os.getpid()}" in (run / LOCK_FILE).read_text()  # put back
    (run / LOCK_FILE).unlink()
    (run / LOCK_FILE).write_text("pid 1 on elsewhere\n")  # replaced by hand, unlocked
    assert first.lost() is None and f"pid {os.getpid()}" in (run / LOCK_FILE).read_text()
    run.rename(tmp_path / "moved")
    run.mkdir()
    assert "was moved or replaced" in first.lost()
    first.abandon()
    assert not first.held


@pytest.mark.parametrize("lock_file", ["empty", "absent", "the previous trainer's"])
def test_a_trainer_arriving_before_the_holder_named_itself_still_names_it(lock_file, tmp_path):
    """Two trainers started together: the second can find the directory locked and .lock not made yet,
    or made and still empty, or (a resumed run) still naming the run's previous trainer, which has ended
    (the holder makes it and writes its name right after locking the directory). It waits for the name
    rather than saying "another process" or naming a process that is gone."""
    import socket
    import subprocess
    import threading

    run = tmp_path / "run"
    first = RunDirLock(run)
    first.acquire()
    (run / LOCK_FILE).unlink()  # the moments between the holder's directory lock and its name
    if lock_file == "empty":
        (run / LOCK_FILE).write_text("")
    elif lock_file == "the previous trainer's":
        ended = subprocess.Popen(["true"])
        ended.wait()
        (run / LOCK_FILE).write_text(f"pid {ended.pid} on {socket.gethostname()}\n")
    later = threading.Timer(0.2, lambda: (run / LOCK_FILE).write_text("pid 4242 on elsewhere\n"))
    later.start()
    with pytest.raises(UserError, match="in use by pid 4242 on elsewhere, which is training this run"):
        RunDirLock(run).acquire()
    later.join()


def test_a_lock_file_naming_an_ended_process_is_never_quoted(tmp_path, monkeypatch):
    """.lock still names the run's previous trainer, gone, when the wait for the holder's name runs out:
    the line says "another process", not a PID that is not running."""
    import socket
    import subprocess

    from pretrainer.artifacts import run_lock

    monkeypatch.setattr(run_lock, "HOLDER_NAMED_WITHIN_S", 0.05)
    run = tmp_path / "run"
    first = RunDirLock(run)
    first.acquire()
    ended = subprocess.Popen(["true"])
    ended.wait()
    (run / LOCK_FILE).write_text(f"pid {ended.pid} on {socket.gethostname()}\n")
    with pytest.raises(UserError, match="in use by another process, which is training this run"):
        RunDirLock(run).acquire()


def test_where_directories_cannot_be_locked_a_taken_lock_file_is_noticed(tmp_path):
    """On a file system without directory locks (the lock then is .lock's alone), a .lock removed and
    taken by a second trainer: the first finds it before its next step."""
    run = tmp_path / "run"
    first = RunDirLock(run)
    first.acquire()
    first._release_dir()  # as acquire() leaves it where flock on a directory fails
    (run / LOCK_FILE).unlink()
    second = RunDirLock(run)
    second.acquire()
    assert f"pid {os.getpid()} on" in first.lost() and "removed or replaced" in first.lost()
    second.close()


def test_a_file_system_without_locks_is_one_line_with_the_fix_and_leaves_nothing(tmp_path, monkeypatch):
    """flock failing with ENOLCK (NFS without its lock service): there is no such mount here, so the
    call fails as it would there."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "new" / "run"
    with pytest.raises(UserError, match="does not support file locks.*choose a run.dir"):
        RunDirLock(run).acquire()
    assert list(tmp_path.iterdir()) == [], "no empty run dir, no .lock left"
