"""What the verbs print: a reader that stops early (`| head`) or a console that is gone is not an
error (core/streams.py)."""

from __future__ import annotations

import sys

from pretrainer.core.streams import print_line


def print_to_stdout(text: str) -> None:
    """Print text; a reader that stops early (`pretrainer config | head -3`) is not an error."""
    print_line(text)


def print_to_stderr(text: str) -> None:
    """A last line on stderr (an error, why a run stopped); a console that is gone is no error: the run
    dir's exit.json and train.log say the same."""
    print_line(text, sys.stderr, last_words=True)
