"""The training verbs: `train` (one process, or --nproc under torchrun), `budget-check`, `postmortem`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrainer.core.errors import UserError


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from pretrainer.artifacts.run_config import load_train_config

    cfg = load_train_config(args.config, overrides)  # check the config before starting N processes
    if args.nproc > 1:
        from pretrainer.train.launch import launch

        sys.stdout.flush()
        return launch(
            args.nproc, cfg.parallel.shutdown_timeout_s, [*([args.config] if args.config else []), *overrides]
        )
    from pretrainer.train.loop import train

    train(cfg)
    return 0


def cmd_budget_check(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the budget contract once against budget.json (or the estimate) and say what the trainer would
    do."""
    from pretrainer.config.load import load_config
    from pretrainer.train.budget import BudgetGuard

    cfg = load_config(args.config, overrides)
    if not cfg.budget.cap_usd:
        raise UserError("budget-check: set --budget.cap_usd (and --budget.file, --budget.usd_per_gpu_hour)")
    guard = BudgetGuard(cfg.budget, args.gpus)
    decision = guard.check(args.elapsed_hours * 3600, args.remaining_hours * 3600, force=True)
    reading = decision.reading
    if reading.problem:
        print(f"note: {reading.problem}")
    print(
        f"source: {'budget.json' if reading.source == 'file' else 'estimate'}; spent "
        f"${reading.spent_usd:.2f}, "
        f"projected ${reading.projected_total_usd:.2f}, rate ${reading.rate_usd_per_hr:.2f}/h; "
        f"warn at ${guard.warn_usd:.2f}, cap ${cfg.budget.cap_usd:.2f}"
    )
    effect = {
        "ok": "continue",
        "warn": "continue with a warning",
        "stop": "write a checkpoint, then exit",
        "halt": "exit at once, no checkpoint",
    }[decision.action]
    print(f"decision: {decision.action} -> the trainer would {effect} (exit code {decision.exit_code})")
    return 0 if args.dry_run else decision.exit_code


def cmd_postmortem(args: argparse.Namespace) -> None:
    from pretrainer.analysis.report.postmortem import write_postmortem

    path, _, summary = write_postmortem(Path(args.run))
    print(f"wrote {path}: {summary}")
