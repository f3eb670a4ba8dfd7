"""A real terminal in this process (a pty, as tmux gives one) for what draws progress bars."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import termios


def terminal(columns: int = 120):
    """(master fd to read what was drawn, a text file on the terminal of `columns` columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w")


def drawn(master: int) -> str:
    """What reached the terminal so far: read until it has been quiet for 0.2 s."""
    shown = b""
    while select.select([master], [], [], 0.2)[0]:
        shown += os.read(master, 1 << 16)
    return shown.decode(errors="replace")
