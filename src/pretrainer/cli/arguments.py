"""Arguments several verbs share: the sampling settings (sample, chat), which checkpoint of a run dir
a verb reads, and train's list of config keys."""

from __future__ import annotations

import argparse


def add_generation_arguments(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float) -> None:
    """What sample and chat share: the run, the sampling settings and the device."""
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir (its newest intact checkpoint) or a checkpoint dir",
    )
    add_checkpoint_choice(p)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"tokens to generate per sample or reply (default {max_new_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"softmax temperature; 0 = greedy (default {temperature})",
    )
    p.add_argument(
        "--top-k", type=int, default=50, help="sample from the k most likely tokens; 0 = all (default 50)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the same seed and input give the same text (default 0)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."
    )


def train_epilog() -> str:
    from pretrainer.config.doc import keys_reference

    return (
        "example: pretrainer train configs/tiny-cpu.toml --optim.lr=3e-4 --train.max_steps=200\n\n"
        "config keys: --section.key=value overrides the TOML file's value; a bare boolean flag "
        "(--train.compile)\n"
        "means true; '-' and '_' are the same in keys. `pretrainer config CONFIG [overrides]` prints the "
        "resolved\n"
        "config with this help.\n\n" + keys_reference()
    )


def add_checkpoint_choice(p: argparse.ArgumentParser) -> None:
    """--checkpoint newest|best: which of a run dir's checkpoints a verb reads."""
    p.add_argument(
        "--checkpoint",
        choices=("newest", "best"),
        default="newest",
        help="of a run dir: its newest intact checkpoint (default) or the one with the lowest val loss "
        "(kept by ckpt.keep_best)",
    )
