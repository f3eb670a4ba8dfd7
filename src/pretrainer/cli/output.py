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
