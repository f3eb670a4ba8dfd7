"""A pytest plugin (conftest.py loads it): tests marked `quiet` compare wall-clock times, so under
`pytest -n N` (pytest-xdist; `make test`) each runs while no other test does.

Every test holds a shared lock on one file for its whole protocol (setup with its module fixtures, call,
teardown); a quiet test takes the lock exclusively. The turnstile, held by a quiet test while it waits,
keeps other tests from starting meanwhile (shared holders coming and going would otherwise starve it).

Each wait costs the machine: the quiet test's worker idles until the other workers' running tests end,
then they idle until it ends. Under `--dist loadfile` (make test) this plugin's scheduler therefore
makes the quiet tests one unit of work, run last and back to back on one worker, which keeps the lock
from one to the next: the others drain once, not once per quiet test. Every other unit is a test file
(its module fixtures built once), in the order collected: the process-heavy tiers first, the many
small unit tests last, to even out the end. (The scheduler learns which tests are quiet from a file
each worker writes as it collects: the controller collects nothing itself.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quiet: compares wall-clock times, so under `pytest -n N` it runs while no other test does"
    )


def session_files(run: str) -> Path:
    """The stem of the files one session's workers share: the locks and each worker's quiet test ids."""
    return Path(tempfile.gettempdir()) / f"pytest-quiet-{run}"


@contextlib.contextmanager
def machine_share(quiet: bool):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one session
    if run is None:
        yield
        return
    files = session_files(run)
    with open(f"{files}.turnstile", "a") as turnstile, open(f"{files}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not quiet:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
        if quiet:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_quiet(item) -> bool:
    return item.get_closest_marker("quiet") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    run, worker = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_XDIST_WORKER")
    if run is None or worker is None:
        return
    quiet = [item for item in items if is_quiet(item)]
    items[:] = [item for item in items if not is_quiet(item)] + quiet
    Path(f"{session_files(run)}-{worker}.ids").write_text("".join(f"{item.nodeid}\n" for item in quiet))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class QuietLastScheduling(LoadFileScheduling):
        """loadfile, the quiet tests one unit of their own, every unit in the order collected."""

        quiet: frozenset[str] = frozenset()  # until every worker has collected

        def schedule(self) -> None:
            if self.collection is None:  # the first call: every worker has collected
                self.config.option.loadscopereorder = False
                stem = session_files(self.nodes[0].workerinput["testrunuid"])
                self.quiet = frozenset(
                    nodeid
                    for file in stem.parent.glob(f"{stem.name}-*.ids")
                    for nodeid in file.read_text().splitlines()
                )
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return "quiet" if nodeid in self.quiet else super()._split_scope(nodeid)

    return QuietLastScheduling(config, log)


_kept: contextlib.ExitStack | None = None  # a quiet test's exclusive share, kept while the next is quiet too


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _kept
    share, _kept = _kept, None
    if share is None:
        share = contextlib.ExitStack()
        share.enter_context(machine_share(is_quiet(item)))
    try:
        return (yield)
    finally:
        if is_quiet(item) and nextitem is not None and is_quiet(nextitem):
            _kept = share
        else:
            share.close()
