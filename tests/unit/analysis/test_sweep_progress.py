"""A parallel sweep's progress: its runs train in child processes whose bars go to their logs, so the
sweep draws its own bar on the terminal (steps of all runs, which are running) from the runs'
metrics.jsonl; never in a pipe, and its own lines never land on the bar's row."""

from __future__ import annotations

import json

from support.pty_terminal import drawn, terminal

from pretrainer.analysis.scaling.ladder import RunSpec
from pretrainer.analysis.scaling.sweep import SweepProgress
from pretrainer.artifacts.metrics import last_step
from pretrainer.config.schema import Config
from pretrainer.core.streams import beside_bars


def run_spec(name: str, run_dir, steps: int) -> RunSpec:
    cfg = Config()
    cfg.train.max_steps, cfg.run.dir = steps, str(run_dir)
    return RunSpec(name, cfg, params_total=1, params_non_embedding=1, flops_per_token=6, tokens=steps)


def write_metrics(path, steps, torn: bool = False) -> None:
    path.parent.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 5.0}) for s in steps] + [json.dumps({"event": "alert"})]
    path.write_text("\n".join(lines) + ("\n" + '{"step": 99, "lo' if torn else "\n"))


def test_last_step_reads_the_files_end_past_torn_lines_and_records_without_a_step(tmp_path):
    path = tmp_path / "a" / "metrics.jsonl"
    assert last_step(path) == 0  # not started
    write_metrics(path, range(1, 5001), torn=True)
    assert path.stat().st_size > 1 << 16  # only the end is read
    assert last_step(path) == 5000


def test_a_parallel_sweep_draws_the_steps_of_all_its_runs_on_a_terminal(tmp_path):
    runs = [run_spec("l1", tmp_path / "l1", 20), run_spec("l2", tmp_path / "l2", 40)]
    write_metrics(tmp_path / "l1" / "metrics.jsonl", range(10, 21, 10))  # finished
    write_metrics(tmp_path / "l2" / "metrics.jsonl", range(10, 31, 10), torn=True)  # at step 30
    master, tty = terminal()
    bar = SweepProgress(runs, file=tty)
    bar.update(["l2"])
    tty.flush()
    shown = drawn(master)
    assert "sweep:" in shown and "50/60" in shown and "running l2" in shown, repr(shown)
    assert "?step/s" in shown  # steps trained before the first reading are not a rate
    say = beside_bars(lambda line: print(line, file=tty, flush=True), file=tty)
    say("sweep: run l2 finished")
    shown = drawn(master)
    line = shown.index("sweep: run l2 finished")
    assert shown[line - 1] in "\r\n", repr(shown)  # the bar was cleared first: the line starts at column 0
    assert "sweep:" in shown[line + 10 :], repr(shown)  # and drawn again below it
    bar.close()


def test_a_parallel_sweep_draws_nothing_into_a_pipe_or_file(tmp_path):
    runs = [run_spec("l1", tmp_path / "l1", 20)]
    write_metrics(tmp_path / "l1" / "metrics.jsonl", [10])
    with open(tmp_path / "log", "w") as log:
        bar = SweepProgress(runs, file=log)
        bar.update(["l1"])
        bar.close()
        print("sweep: run l1 finished", file=log)
    assert (tmp_path / "log").read_text() == "sweep: run l1 finished\n"
