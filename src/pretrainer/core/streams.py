"""Writing to a console that may be gone: a reader that stopped early (`| head`), a closed pipe, a
terminal or multiplexer that vanished. Such a stream is switched off (its fd pointed at /dev/null,
so that the flush at exit, or a child writing to it, does not fail again); nothing else is lost:
the run dir's files say the same.

    print_line("error: ...", sys.stderr)   # a last line; never raises because the console is gone
    switch_off(1)                          # what a console tee does when it finds stdout gone
"""

from __future__ import annotations

import errno
import os
import sys

GONE = (errno.EPIPE, errno.EIO, errno.ENXIO, errno.EBADF)  # a reader or terminal that is no more


def switch_off(fd: int) -> None:
    """Point `fd` at /dev/null (Python's docs, signal, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def print_line(text: str, stream=None, last_words: bool = False) -> None:
    """Print `text` on `stream` (stdout by default); a stream that is gone is switched off, not an
    error. Any other failure (a full disk under a redirected stdout) is raised, unless `last_words`
    (an error or a stop being reported: nothing more can be done, and the run's files hold it)."""
    stream = stream if stream is not None else sys.stdout
    try:
        print(text, file=stream, flush=True)
    except OSError as e:
        if e.errno in GONE:
            switch_off(stream.fileno())
        elif not last_words:
            raise


class Tolerant:
    """A text stream whose reader may go (`pretrainer eval RUN | head -1`): once a write or flush finds
    it gone it is switched off and the command goes on to write its files (a BrokenPipeError there lost
    eval's JSON). Anything else it passes to the stream it wraps."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._gone(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._gone(e)

    def _gone(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        switch_off(self.stream.fileno())

    def __getattr__(self, name):
        return getattr(self.stream, name)


def progress(
    total: int,
    desc: str,
    unit: str,
    *,
    file=None,
    unit_scale: bool = False,
    initial: int = 0,
    quiet: bool = False,
):
    """A progress bar on a terminal (`file`, stderr by default; none in a file or pipe, so never a log
    line), in the training bar's style, for work that takes more than a few seconds: eval's tasks,
    serve-cost's variants, a parallel sweep, a large export (`quiet`: none at all). Use as a context
    manager; .update(n), .set_postfix_str(what)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        initial=initial,
        file=file,
        dynamic_ncols=True,
        mininterval=1.0,
        disable=True if quiet else None,
    )


BAR_FROM_BYTES = 256 << 20  # weights below this convert and write in a few seconds: no bar


def weights_bar(tensors: dict, desc: str):
    """A bar over converting `tensors` (their bytes), for large weights on a terminal only."""
    total = sum(tensor.nelement() * tensor.element_size() for tensor in tensors.values())
    return progress(total, desc, "B", unit_scale=True, quiet=total < BAR_FROM_BYTES)


def beside_bars(say, file=None):
    """`say`, with any progress bar on its terminal (`file`; stdout and stderr count as one) cleared
    before the line and redrawn after it, so a line never lands on a bar's row."""
    from tqdm import tqdm

    def said(line: str) -> None:
        with tqdm.external_write_mode(file=file):
            say(line)

    return said
