"""What the console (and train.log) shows for a logged step: one line that reads well in a file."""

from __future__ import annotations

import shlex
from pathlib import Path

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.config.schema import Config
from pretrainer.train.distributed import DistEnv

# --- the console ---


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_line(record: dict, end_step: int, tokens_per_step: int) -> str:
    """One logged step in one line that reads well in a file: step/total, loss, lr, grad norm, tok/s,
    MFU and $ when known, and the time left at the current speed."""
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
    if record["tokens_per_s"] > 0:
        parts.append(
            f"ETA {format_duration((end_step - record['step']) * tokens_per_step / record['tokens_per_s'])}"
        )
    return " | ".join(parts)


def resume_command(cfg: Config, env: DistEnv) -> str:
    """The command that continues this run (its saved config does the rest)."""
    return f"pretrainer train --run.dir={shlex.quote(cfg.run.dir)}" + (
        f" --nproc {env.world_size}" if env.world_size > 1 else ""
    )


def closing_lines(cfg: Config, env: DistEnv, step: int, tokens: int, wall_s: float) -> str:
    """How the run ended, where its checkpoint is, and what to run next."""
    how = "stopped early (train.stop_at_step)" if step < cfg.train.max_steps else "finished"
    return (
        f"{how} at step {step}: {tokens:,} tokens, {wall_s:.1f}s; checkpoint "
        f"{latest_checkpoint(Path(cfg.run.dir))}\n"
        + next_commands(cfg, env, finished=step >= cfg.train.max_steps)
    )


def next_commands(cfg: Config, env: DistEnv, finished: bool) -> str:
    """The run's last lines: what to do with it next, with its real (absolute) path."""
    run = shlex.quote(cfg.run.dir)
    then = "" if finished else f"\n  {resume_command(cfg, env)}        # continue the run"
    return (
        f'next:{then}\n  pretrainer sample {run} --prompt "..."   # generate text\n'
        f"  pretrainer eval {run}                   # val loss, bits per byte, tasks and probes of the "
        f"newest checkpoint\n"
        f"  pretrainer export {run}                 # report: manifest, metrics.csv, plots ({run}/report)\n"
        f"  pretrainer export {run} --format hf     # a transformers model ({run}/hf)"
    )
