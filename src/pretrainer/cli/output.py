"""What the verbs print to stdout: a reader that stops early (`| head`) is not an error."""

from __future__ import annotations

import os
import sys


def print_to_stdout(text: str) -> None:
    """Print text; a reader that stops early (`pretrainer config | head -3`) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's docs (signal, "Note on SIGPIPE"): point stdout at devnull so the flush at exit does not
        # fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def print_to_stderr(text: str) -> None:
    """A last line on stderr (an error, why a run stopped); a console that is gone is no error: the run
    dir's exit.json and train.log say the same."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
