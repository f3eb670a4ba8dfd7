"""A pytest plugin (conftest.py loads it): tests marked `quiet` compare wall-clock times, so under
`pytest -n N` (pytest-xdist; `make test`) each runs while no other test does.

Every test holds a shared lock on one file for its whole protocol (setup with its module fixtures, call,
teardown); a quiet test takes the lock exclusively. The turnstile, held by a quiet test while it waits,
keeps other tests from starting meanwhile (shared holders coming and going would otherwise starve it)."""

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


@contextlib.contextmanager
def machine_share(quiet: bool):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one session
    if run is None:
        yield
        return
    files = Path(tempfile.gettempdir()) / f"pytest-quiet-{run}"
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with machine_share(item.get_closest_marker("quiet") is not None):
        return (yield)
