"""The trainer on a real terminal (a pty, as tmux gives it): the progress bar never swallows the start
of a log line (it printed `...2.88s/step]s` then `tep 10/360 | loss ...`), at 80 and 200 columns."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from helpers import tiny_overrides


def run_on_a_terminal(argv: list[str], columns: int) -> str:
    """`argv` with stdin, stdout and stderr on one pty of `columns` columns -> everything it drew."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    child = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert child.wait(timeout=120) == 0, drawn.decode(errors="replace")[-3000:]
    return drawn.decode(errors="replace")


@pytest.mark.parametrize("columns", [80, 200])
def test_log_lines_start_at_column_0_beside_the_progress_bar(stdlib_data, tmp_path, columns):
    settings = {"train.max_steps": 40, "log.every": 10, "eval.every": 20}
    args = [str(a) for a in tiny_overrides(stdlib_data, tmp_path / "run", **settings)]
    drawn = run_on_a_terminal([sys.executable, "-m", "pretrainer", "train", *args], columns)
    assert "train:" in drawn and "step/s" in drawn or "s/step" in drawn, drawn[-2000:]  # the bar drew
    lines = list(re.finditer(r"step \d+/40 \| loss|step \d+: val loss", drawn))
    assert len(lines) == 7, drawn[-3000:]  # 4 logged steps, val at 0, 20 and 40
    for line in lines:
        before = drawn[line.start() - 1]
        assert before in "\r\n", repr(drawn[max(0, line.start() - 80) : line.start() + 30])
