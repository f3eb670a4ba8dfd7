"""A pytest plugin (conftest.py loads it): tests marked `quiet` compare wall-clock times, so under
`pytest -n N` (pytest-xdist; `make test`) no other test's processes share the machine with them.

    @pytest.mark.quiet               times its own work, one process at a time: needs a core to itself
    @pytest.mark.quiet(alone=True)   reads the machine itself (its load): nothing else may run

Every test holds a shared lock on one file for its whole protocol (setup with its module fixtures, call,
teardown); a test that takes the machine takes it exclusively. The turnstile, held by such a test while
it waits, keeps other tests from starting meanwhile (shared holders coming and going would starve it).

Each such wait costs the machine: the waiting worker idles until the others' running tests end, then they
idle until it ends. Under `--dist loadfile` (make test) this plugin's scheduler therefore runs the quiet
tests last, each file's quiet tests a unit of work, the `alone` ones first, and writes a file once every
other test has ended, another once the `alone` ones have too. An `alone` test waits for the first and
takes the lock exclusively; any other quiet test waits for both, then shares the lock with the other
quiet tests (the workers are told so: `quiet_pairs`): two at once, a core each, each worker taking the
next quiet unit as it needs one. Without this scheduler every quiet test takes the lock exclusively.
Every other unit is a test file (its module fixtures built once), in the order collected: the
process-heavy tiers first, the many small unit tests last, to even out the end. (The scheduler learns
which tests are quiet from a file each worker writes as it collects: the controller collects nothing
itself.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

import pytest

QUIET_UNIT = "quiet::"  # the scheduler's scopes of a file's quiet tests: its `alone` ones, its others
ALONE_UNIT = QUIET_UNIT + "alone::"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "quiet(alone=False): compares wall-clock times, so under `pytest -n N` it runs after the other "
        "tests, on a core of its own (alone=True: while no other test runs)",
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controller: absent under -p no:xdist
def pytest_configure_node(node):
    """Tell each worker whether this plugin's scheduler runs the session (then quiet tests may pair)."""
    node.workerinput["quiet_pairs"] = node.config.getoption("dist") == "loadfile"


def session_files(run: str) -> Path:
    """The stem of the files one session's workers share: the locks and each worker's quiet test ids."""
    return Path(tempfile.gettempdir()) / f"pytest-quiet-{run}"


def ended_file(run: str, which: str) -> Path:
    """Made by the scheduler once every test but the quiet ones has ended ("others"), and once the
    `alone` ones have too ("alone"): an `alone` test waits for the first, any other quiet test for both."""
    return Path(f"{session_files(run)}.{which}-ended")


@contextlib.contextmanager
def machine_share(exclusive: bool):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one session
    if run is None:
        yield
        return
    files = session_files(run)
    with open(f"{files}.turnstile", "a") as turnstile, open(f"{files}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_quiet(item) -> bool:
    return item.get_closest_marker("quiet") is not None


def is_alone(item) -> bool:
    marker = item.get_closest_marker("quiet")
    return marker is not None and marker.kwargs.get("alone", False)


def paired(item) -> bool:
    """Whether this plugin's scheduler runs the session: then quiet tests run after every other test."""
    return getattr(item.config, "workerinput", {}).get("quiet_pairs", False)


def takes_the_machine(item) -> bool:
    """An exclusive share: an `alone` test's, and a quiet test's unless the scheduler pairs them."""
    return is_alone(item) or (is_quiet(item) and not paired(item))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    run, worker = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_XDIST_WORKER")
    if run is None or worker is None:
        return
    quiet = sorted((item for item in items if is_quiet(item)), key=lambda item: not is_alone(item))
    items[:] = [item for item in items if not is_quiet(item)] + quiet  # last, the `alone` ones first
    Path(f"{session_files(run)}-{worker}.ids").write_text(
        "".join(f"{'alone ' if is_alone(item) else ''}{item.nodeid}\n" for item in quiet)
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class QuietLastScheduling(LoadFileScheduling):
        """loadfile, every unit in the order collected, each file's quiet tests a unit of their own (last);
        the ended files written once every other test, then every `alone` one, has ended."""

        quiet: frozenset[str] = frozenset()  # until every worker has collected
        alone: frozenset[str] = frozenset()
        told: frozenset[str] = frozenset()  # the ended files written so far

        def schedule(self) -> None:
            if self.collection is None:  # the first call: every worker has collected
                self.config.option.loadscopereorder = False
                stem = session_files(self.nodes[0].workerinput["testrunuid"])
                lines = {
                    line
                    for file in stem.parent.glob(f"{stem.name}-*.ids")
                    for line in file.read_text().splitlines()
                }
                self.quiet = frozenset(line.removeprefix("alone ") for line in lines)
                self.alone = frozenset(
                    line.removeprefix("alone ") for line in lines if line.startswith("alone ")
                )
            super().schedule()
            self._tell_if_the_others_ended()

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if nodeid in self.alone:
                return ALONE_UNIT + scope
            return QUIET_UNIT + scope if nodeid in self.quiet else scope

        def _assign_work_unit(self, node) -> None:
            """A quiet unit only to a worker with at most one test queued, the one it holds back until it
            knows the next (a worker runs a test only then): one unit ahead, not two or three behind a
            long one while the other worker runs out."""
            quiet_next = next(iter(self.workqueue)).startswith(QUIET_UNIT)
            if not quiet_next or self._pending_of(self.assigned_work.get(node, {})) <= 1:
                super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            self._tell_if_the_others_ended()

        def _tell_if_the_others_ended(self) -> None:
            run = self.nodes[0].workerinput["testrunuid"]
            for which, still_to_end in (
                ("others", lambda scope: not scope.startswith(QUIET_UNIT)),
                ("alone", lambda scope: not scope.startswith(QUIET_UNIT) or scope.startswith(ALONE_UNIT)),
            ):
                if which in self.told:  # once: this runs at every test's end
                    continue
                ended = not any(still_to_end(scope) for scope in self.workqueue) and all(
                    all(unit.values())
                    for work in self.assigned_work.values()
                    for scope, unit in work.items()
                    if still_to_end(scope)
                )
                if ended:
                    ended_file(run, which).touch()
                    self.told |= {which}

    return QuietLastScheduling(config, log)


_kept: contextlib.ExitStack | None = None  # an exclusive share, kept while the next test takes one too


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _kept
    share, _kept = _kept, None
    if share is None:
        if is_quiet(item) and paired(item):  # after every other test: the scheduler's files say when
            for which in ("others",) if is_alone(item) else ("others", "alone"):
                while not ended_file(item.config.workerinput["testrunuid"], which).exists():
                    time.sleep(0.05)
        share = contextlib.ExitStack()
        share.enter_context(machine_share(takes_the_machine(item)))
    try:
        return (yield)
    finally:
        if takes_the_machine(item) and nextitem is not None and takes_the_machine(nextitem):
            _kept = share
        else:
            share.close()
