"""Per-step speed of the optimizers side by side: the trainer on the quickstart config, in this process,
alternating optimizers (adamw, muon, adamw, muon, ...) so that both see the same machine state.

    python benchmarks/optimizer_speed.py --data data/stdlib-bpe4k [--names adamw,muon] [--steps 60]
        [--warmup 10] [--repeats 3] [--variant 'NAME=OVERRIDES' ...]

--variant (repeatable) compares recipes instead of optimizers: each is a name and the config overrides
that make it (e.g. --variant 'before=--model.qk_norm=false' --variant 'now='), alternating the same way.

Each run trains W + N steps (log.every = 5, no evaluation in the window, no checkpoint before the end);
tokens/s is the metrics.jsonl records after step W: their tokens over the time they cover. The table
gives each optimizer's median over the repeats, its spread ((max - min) / median), and its speed as a
fraction of the first name's. The target this project states for Muon: within 15% of AdamW's speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import load_config
from pretrainer.train.loop import train


def tokens_per_s(run: Path, warmup: int) -> float:
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    start = next(r for r in records if r["step"] >= warmup)
    end = records[-1]
    return (end["tokens"] - start["tokens"]) / (end["elapsed_s"] - start["elapsed_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", required=True, help="a prepared data dir (make quickstart: data/stdlib-bpe4k)"
    )
    parser.add_argument("--config", default="configs/tiny-cpu.toml")
    parser.add_argument("--names", default="adamw,muon")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDES (space-separated)")
    args = parser.parse_args()
    variants = {name: [f"--optim.name={name}"] for name in args.names.split(",")}
    if args.variant:
        variants = {v.split("=", 1)[0]: v.split("=", 1)[1].split() for v in args.variant if "=" in v}
        if len(variants) != len(args.variant):
            parser.error("--variant takes NAME=OVERRIDES")
    names = list(variants)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in names:
                run = Path(tmp) / f"{name}-{repeat}"
                overrides = [
                    f"--data.dir={args.data}",
                    f"--run.dir={run}",
                    *variants[name],
                    f"--train.max_steps={args.warmup + args.steps}",
                    "--log.every=5",
                    "--eval.every=0",
                    "--eval.tasks_every=0",
                    "--ckpt.every=0",
                    "--track.backends=none",
                ]
                train(load_config(args.config, overrides))
                speeds[name].append(tokens_per_s(run, args.warmup))
    base = statistics.median(speeds[names[0]])
    print(
        f"| {'variant' if args.variant else 'optimizer'} | tokens/s (median of {args.repeats}) | spread "
        f"| vs {names[0]} |"
    )
    print("|---|---|---|---|")
    for name in names:
        median = statistics.median(speeds[name])
        spread = (max(speeds[name]) - min(speeds[name])) / median
        print(f"| {name} | {median:,.0f} | {spread:.1%} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
