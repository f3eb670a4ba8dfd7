"""The trainer on a real terminal (a pty, as tmux gives it): the progress bar never swallows the start
of a log line (it printed `...2.88s/step]s` then `tep 10/360 | loss ...`), at 80 and 200 columns."""

from __future__ import annotations

import os
import re

import pytest
from helpers import fork_cli_to, tiny_overrides
from support.pty_terminal import terminal


def run_on_a_terminal(argv: list[str], columns: int) -> str:
    """`pretrainer ARGV` with stdout and stderr on one pty of `columns` columns -> everything it drew.
    (A child forked from this process: the terminal is what is under test, not an interpreter's start.)"""
    master, tty = terminal(columns)
    child = fork_cli_to(tty.fileno(), *argv)
    tty.close()
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
    child.join(120)
    assert child.exitcode == 0, drawn.decode(errors="replace")[-3000:]
    return drawn.decode(errors="replace")


@pytest.mark.parametrize("columns", [80, 200])
def test_log_lines_start_at_column_0_beside_the_progress_bar(stdlib_data, tmp_path, columns):
    settings = {"train.max_steps": 40, "log.every": 10, "eval.every": 20}
    args = [str(a) for a in tiny_overrides(stdlib_data, tmp_path / "run", **settings)]
    drawn = run_on_a_terminal(["train", *args], columns)
    assert "train:" in drawn and "step/s" in drawn or "s/step" in drawn, drawn[-2000:]  # the bar drew
    lines = list(re.finditer(r"step \d+/40 \| loss|step \d+: val loss", drawn))
    assert len(lines) == 7, drawn[-3000:]  # 4 logged steps, val at 0, 20 and 40
    for line in lines:
        before = drawn[line.start() - 1]
        assert before in "\r\n", repr(drawn[max(0, line.start() - 80) : line.start() + 30])


def test_eval_shows_its_progress_on_a_terminal_and_nothing_in_a_pipe(stdlib_data, tmp_path, run_cli):
    """`eval` over a task suite printed nothing for 20 minutes: on a terminal it draws a bar (items,
    the task at hand), and its lines still start at column 0; piped, its output holds no bar."""
    import json

    from helpers import tiny_config

    from pretrainer.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 2, "eval.every": 0}))
    tasks = tmp_path / "toy.jsonl"
    items = [
        {"type": "mc", "context": f"def f{i}(x):\n    return", "choices": [" x", " 1"], "gold": 0}
        for i in range(6)
    ]
    tasks.write_text("".join(json.dumps(item) + "\n" for item in items))
    argv = ["eval", str(run), "--tasks", str(tasks), "--eval.batches=1"]
    drawn = run_on_a_terminal(argv, 120)
    assert re.search(r"eval tasks: +\d+%.*\d+/6", drawn), drawn[-2000:]
    assert re.search(r"[\r\n]suite score", drawn), drawn[-2000:]
    code, out, err = run_cli(*argv)  # in this process, its output captured: not a terminal
    assert code == 0 and "eval tasks" not in out + err and "suite score" in out + err, out + err
