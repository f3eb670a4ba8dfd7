"""A console that is gone is switched off, not an error; any other write failure still is one."""

from __future__ import annotations

import os

import pytest

from pretrainer.core.streams import print_line


def test_a_stream_whose_reader_left_is_switched_off():
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` has exited
    with os.fdopen(write_end, "w") as stream:
        print_line("step 1", stream)  # EPIPE: no error
        print_line("step 2", stream)  # the fd now goes to /dev/null
        assert os.path.samefile(f"/proc/self/fd/{stream.fileno()}", os.devnull)


def test_a_full_disk_is_still_an_error_unless_these_are_last_words():
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below, where its unwritten buffer fails again)
    with pytest.raises(OSError):
        print_line("step 1", full)
    print_line("error: ...", full, last_words=True)
    with pytest.raises(OSError):
        full.close()
