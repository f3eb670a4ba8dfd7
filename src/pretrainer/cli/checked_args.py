"""Arguments checked as config keys are: every number finite and within its option's range, and any
bad argument one `error:` line (exit 2) instead of argparse's usage block."""

from __future__ import annotations

import argparse

# The numbers each verb's options allow, by option (dest); any other number must be finite. A value
# outside is one line, as a config key's is (config/load.py).
OPTION_RANGES = {
    "val_fraction": "(0, 1)",
    "seed": "[0, 4294967295]",
    "workers": ">= 0",
    "max_docs": ">= 0",
    "shard_tokens": ">= 1",
    "nproc": ">= 1",
    "num_fewshot": ">= 0",
    "limit": ">= 0",
    "tokens": "> 0",
    "tokens_per_param": "> 0",
    "gpus": ">= 1",
    "peak_tflops": "> 0",
    "gpu_memory_gb": "> 0",
    "gpu_watts": "> 0",
    "mfu": "(0, 1]",
    "usd_per_gpu_hour": ">= 0",
    "usd_per_hour": ">= 0",
    "resamples": ">= 10",
    "max_new_tokens": ">= 1",
    "temperature": ">= 0",
    "top_k": ">= 0",
    "num_samples": ">= 1",
    "prompt_tokens": ">= 0",
    "new_tokens": ">= 0",
    "repeats": ">= 1",
    "warmup": ">= 0",
    "val_batches": ">= 1",
    "group_size": ">= 1",
    "threads": ">= 0",
    "elapsed_hours": ">= 0",
    "remaining_hours": ">= 0",
}


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line, `error: ...`, exit 2, as every other bad input is (not argparse's
    usage block)."""

    def error(self, message: str):
        import sys

        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def number(kind: type, allowed: str):
    """An argparse type: an int or a float, finite, within `allowed` ("> 0", "(0, 1]", ...)."""
    from pretrainer.config.load import describe_allowed, out_of_range

    def parse(text: str):
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"expected {describe_allowed(allowed, kind)}, got {text!r}"
            ) from None
        if out_of_range(value, allowed):
            raise argparse.ArgumentTypeError(f"must be {describe_allowed(allowed, kind)}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def checked_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb in action.choices.values():
                checked_numbers(verb)
        elif action.type in (int, float):
            action.type = number(action.type, OPTION_RANGES.get(action.dest, ""))
    return parser
