"""What the console shows, and RUN_DIR/train.log with it: one line per logged step that reads well
in a file. The console is optional: `Console` copies everything printed to train.log (rank 0), and a
console that goes away (`| head`, a closed pipe to tee, a terminal that vanished: EPIPE or EIO) is
switched off while training goes on to its end and its final checkpoint."""

from __future__ import annotations

import io
import os
import shlex
import sys
import time
from pathlib import Path

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.config.schema import Config
from pretrainer.core.streams import GONE, switch_off
from pretrainer.train.component import Component, Step
from pretrainer.train.distributed import DistEnv

# --- the console ---


class Console:
    """sys.stdout and sys.stderr, each copied to train.log once `attach`ed (lines before that are kept
    and written then), each switched off for good when its console is gone. `terminal`: the stream for
    a progress bar (on the console only: its redraws are not log lines)."""

    def __init__(self):
        self.log: io.TextIOBase | None = None
        self.pending: list[str] = []
        self.bar = None  # a progress bar on the terminal: cleared before a line is printed, then redrawn
        self.original = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, 1, self), _Tee(sys.stderr, 2, self)
        self.terminal = _Tee(self.original[1], 2, None)

    def attach(self, path: Path) -> None:
        """Copy to `path` (appended: a resumed run's launches follow each other) from now on."""
        self.log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by close())
        self.log.write("".join(self.pending))
        self.pending = []

    def record(self, text: str) -> None:
        if self.log is not None:
            try:
                self.log.write(text)
            except OSError:  # a full disk: the run's own files say the rest
                pass
        elif len(self.pending) < 10_000:
            self.pending.append(text)

    def close(self) -> None:
        """The streams back as they were, whatever a last flush or closing train.log meets."""
        tees, (sys.stdout, sys.stderr) = (sys.stdout, sys.stderr), self.original
        log, self.log = self.log, None
        for stream in (*tees, log):
            try:
                if stream is not None:
                    stream.flush()
            except OSError:
                pass
        try:
            if log is not None:
                log.close()
        except OSError:  # a full disk: what train.log could not take, the run's other files keep
            pass


class _Tee(io.TextIOBase):
    """A console stream that copies to its Console's log and survives the console going away."""

    def __init__(self, stream, fd: int, console: Console | None):
        self.stream, self.fd, self.console, self.gone = stream, fd, console, False

    def write(self, text: str) -> int:
        bar = self.console.bar if self.console is not None else None
        if self.console is not None:
            self.console.record(text)
        if not self.gone:
            try:
                if bar is not None and text:  # the line starts at column 0, not after the bar's text
                    bar.clear()
                self.stream.write(text)
                self.stream.flush()
                if bar is not None and text.endswith("\n"):
                    bar.refresh()
            except OSError as e:
                self._lost(e)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as e:
                self._lost(e)

    def _lost(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        self.gone = True  # from now on only train.log
        switch_off(self.fd)

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


class ProgressBar(Component):
    """The trainer's console: a progress bar on a terminal (rank 0; its redraws are not train.log's
    lines) and one line per logged step."""

    name = "console"

    def __init__(self, bar, say, end_step: int, step_tokens: int, console=None):
        self.bar, self.say, self.end_step, self.step_tokens = bar, say, end_step, step_tokens
        self.console, self.started = console, None  # (time, step) of this launch's first step
        if console is not None and not bar.disable:
            console.bar = bar

    @classmethod
    def build(cls, trainer) -> ProgressBar:
        from tqdm import tqdm

        bar = tqdm(
            total=trainer.max_steps,
            initial=trainer.state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            disable=True if not trainer.env.is_main else None,  # None: a bar on a terminal only
            file=trainer.console.terminal,
        )
        return cls(bar, trainer.say, trainer.end_step, trainer.start.step_tokens, trainer.console)

    def after_step(self, step: Step) -> None:
        self.bar.n = step.number - 1  # a rollback takes the run back
        self.bar.update(1)
        if self.started is None:
            self.started = (time.perf_counter(), step.number)

    def after_log(self, step: Step) -> None:
        if step.record is not None:
            self.say(step_line(step.record, self.end_step, self.step_tokens, self.seconds_per_step(step)))

    def seconds_per_step(self, step: Step) -> float | None:
        """This launch's average since its first step, evaluations and checkpoints included: the last
        interval's alone swung the ETA from 7 to 48 minutes. None until two steps are timed."""
        if self.started is None or step.number <= self.started[1]:
            return None
        return (time.perf_counter() - self.started[0]) / (step.number - self.started[1])

    def close(self) -> None:
        if self.console is not None:
            self.console.bar = None
        self.bar.close()


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_line(
    record: dict, end_step: int, tokens_per_step: int, seconds_per_step: float | None = None
) -> str:
    """One logged step in one line that reads well in a file: step/total, loss, lr, grad norm, tok/s,
    MFU and $ when known, and the time left: at `seconds_per_step` (the launch's average), else at the
    interval's speed."""
    parts = [
        f"step {record['step']}/{end_step}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "spent_usd" in record:
        parts.append(f"${record['spent_usd']:,.2f}")
    if seconds_per_step is not None:
        parts.append(f"ETA {format_duration((end_step - record['step']) * seconds_per_step)}")
    elif record["tokens_per_s"] > 0:
        parts.append(
            f"ETA {format_duration((end_step - record['step']) * tokens_per_step / record['tokens_per_s'])}"
        )
    return " | ".join(parts)


def resume_command(cfg: Config, env: DistEnv) -> str:
    """The command that continues this run (its saved config does the rest)."""
    return f"pretrainer train --run.dir={shlex.quote(cfg.run.dir)}" + (
        f" --nproc {env.world_size}" if env.world_size > 1 else ""
    )


SWEEP_ENV = "PRETRAINER_SWEEP_DIR"  # set for a sweep's runs: the sweep says what to do next, once


def closing_lines(
    cfg: Config, env: DistEnv, step: int, tokens: int, wall_s: float, *, chat: bool = False
) -> str:
    """How the run ended, where its checkpoint is, and what to run next (`chat`: trained on chat data)."""
    how = "stopped early (train.stop_at_step)" if step < cfg.train.max_steps else "finished"
    return (
        f"{how} at step {step}: {tokens:,} tokens, {wall_s:.1f}s; checkpoint "
        f"{latest_checkpoint(Path(cfg.run.dir))}\n"
        + (
            f"next: the sweep goes on; once it ends, pretrainer fit {shlex.quote(os.environ[SWEEP_ENV])}"
            if os.environ.get(SWEEP_ENV)
            else next_commands(cfg, env, finished=step >= cfg.train.max_steps, chat=chat)
        )
    )


def next_commands(cfg: Config, env: DistEnv, finished: bool, chat: bool = False) -> str:
    """The run's last lines: what to do with it next, with its real (absolute) path."""
    run = shlex.quote(cfg.run.dir)
    then = "" if finished else f"\n  {resume_command(cfg, env)}        # continue the run"
    talk = (
        f"\n  pretrainer chat {run}                   # talk to it (piped: one prompt per line)"
        if chat
        else ""
    )
    return (
        f"next:{then}{talk}"
        f'\n  pretrainer sample {run} --prompt "..."   # generate text\n'
        f"  pretrainer eval {run}                   # val loss, bits per byte, tasks and probes of the "
        f"newest checkpoint\n"
        f"  pretrainer export {run}                 # report: manifest, metrics.csv, plots ({run}/report)\n"
        f"  pretrainer export {run} --format hf     # a transformers model ({run}/hf)"
    )
