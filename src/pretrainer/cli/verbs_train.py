"""The training verbs: `train` (one process, or --nproc under torchrun), `budget-check`, `postmortem`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrainer.cli.arguments import train_epilog
from pretrainer.core.errors import UserError


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from pretrainer.artifacts.run_config import load_train_config

    cfg = load_train_config(args.config, overrides)  # check the config before starting N processes
    check_training_data(cfg.data.dir, cfg.data.mixture)
    if args.nproc > 1:
        from pretrainer.train.launch import launch

        sys.stdout.flush()
        return launch(
            args.nproc, cfg.parallel.shutdown_timeout_s, [*([args.config] if args.config else []), *overrides]
        )
    from pretrainer.train.loop import train

    train(cfg)
    return 0


def check_training_data(data_dir: str, mixture: list[dict]) -> None:
    """The data dirs opened and checked before the trainer's imports (seconds of torch) or torchrun's N
    processes: a missing or damaged data dir is one line at once, not after start-up (under --nproc: not
    one line per worker and torchrun's traceback). Hub datasets are left to the trainer: pulling one
    verifies every file, which the trainer would do again."""
    from pretrainer.data.data_dir import open_training_data
    from pretrainer.data.hub import is_hub_spec

    if not any(is_hub_spec(str(d)) for d in [data_dir, *(source["dir"] for source in mixture)]):
        open_training_data(data_dir, mixture)


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


# --- the command line's grammar for these verbs (cli/parser.py lists them) ---


def add_train(verbs) -> None:
    """`pretrainer train`'s arguments and help."""
    p = verbs.add_parser(
        "train",
        help="train a model; extra --section.key=value arguments override the config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=train_epilog(),
    )
    p.add_argument(
        "config",
        nargs="?",
        help="TOML config file (defaults for anything it leaves out); without one, "
        "--run.dir=R resumes R with its saved config",
    )
    p.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine: runs torchrun --standalone for you"
    )


def add_postmortem(verbs) -> None:
    """`pretrainer postmortem`'s arguments and help."""
    p = verbs.add_parser(
        "postmortem", help="write RUN_DIR/spike-postmortem.md and figures for every detected spike"
    )
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir, or one of its checkpoints (the run's is used)",
    )


def add_budget_check(verbs) -> None:
    """`pretrainer budget-check`'s arguments and help."""
    p = verbs.add_parser(
        "budget-check", help="check a budget.json against the guard's contract; --budget.* overrides follow"
    )
    p.add_argument("config", nargs="?", help="TOML config file (its [budget] section)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the decision and exit 0 (else exit with the trainer's code)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs, for the estimate")
    p.add_argument("--elapsed-hours", type=float, default=0.0, help="hours run so far, for the estimate")
    p.add_argument("--remaining-hours", type=float, default=0.0, help="hours still to run, for the estimate")
