"""The command line's grammar: the verbs in the order `pretrainer --help` lists them (each verb's
arguments and help live beside what it does, in cli/verbs_*.py), and the joining of
`--section.key VALUE` into `--section.key=VALUE`."""

from __future__ import annotations

import argparse

from pretrainer import __version__
from pretrainer.cli import verbs_data, verbs_model, verbs_plan, verbs_train
from pretrainer.cli.checked_args import OneLineParser, checked_numbers

VERB_PARSERS = (
    verbs_data.add_prepare,
    verbs_train.add_train,
    verbs_model.add_eval,
    verbs_plan.add_plan,
    verbs_plan.add_sweep,
    verbs_plan.add_fit,
    verbs_model.add_export,
    verbs_data.add_push,
    verbs_model.add_sample,
    verbs_model.add_chat,
    verbs_model.add_serve_cost,
    verbs_train.add_postmortem,
    verbs_train.add_budget_check,
    verbs_data.add_fetch_gpt2,
    verbs_plan.add_config,
)


def build_parser() -> argparse.ArgumentParser:
    return checked_numbers(verb_parser())


def verb_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pretrainer", description="Pretrain decoder-only language models from scratch."
    )
    parser.add_argument("--version", action="version", version=f"pretrainer {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=OneLineParser)

    for add_verb in VERB_PARSERS:  # in the order `pretrainer --help` lists them
        add_verb(verbs)
    return parser


def join_dotted_overrides(argv: list[str]) -> list[str]:
    """['--optim.lr', '3e-4'] -> ['--optim.lr=3e-4'], so a value is never taken for a positional argument.
    A boolean key takes the next word only when it is true/false/yes/no/on/off/1/0: `--train.compile CONFIG`
    is a bare flag."""
    from pretrainer.config.load import BOOL_WORDS, is_bool_key

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        dotted = arg.startswith("--") and "." in arg and "=" not in arg
        value = argv[i + 1] if dotted and i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if value is not None and (not is_bool_key(arg[2:]) or value.strip().lower() in BOOL_WORDS):
            out.append(f"{arg}={value}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out
