"""8-bit and 4-bit AdamW (or Muon) against AdamW on the quickstart: final validation loss, optimizer
state, speed.

    python benchmarks/lowbit_adamw.py --data data/stdlib-bpe4k [--max-steps 360] [--names
    adamw,adamw8bit,adamw4bit]          # or --names adamw,muon

Trains configs/tiny-cpu.toml once per optimizer (same seed, data and schedule; each in its own process),
then prints a markdown table: final val loss and its difference from AdamW's, the optimizer state's
measured bytes (state.json) against plan's figure, and tokens/s. The tolerance this project states
for the low-bit optimizers is a final validation loss within 3% of AdamW's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrainer.analysis.plan import make_plan
from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import load_config
from pretrainer.data.data_dir import open_training_data

TOLERANCE = 0.03


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", required=True, help="the quickstart's data dir (make quickstart prepares data/stdlib-bpe4k)"
    )
    parser.add_argument("--config", default="configs/tiny-cpu.toml")
    parser.add_argument("--max-steps", type=int, default=360)
    parser.add_argument("--names", default="adamw,adamw8bit,adamw4bit")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names.split(","):
            run = Path(tmp) / name
            overrides = [
                f"--data.dir={args.data}",
                f"--run.dir={run}",
                f"--optim.name={name}",
                f"--train.max_steps={args.max_steps}",
                "--eval.tasks_every=0",
                "--track.backends=none",
                f"--eval.every={args.max_steps}",
            ]
            subprocess.run(
                [sys.executable, "-m", "pretrainer", "train", args.config, *overrides],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            records = read_metrics(run / "metrics.jsonl")
            state = json.loads((latest_checkpoint(run) / "state.json").read_text())
            planned = make_plan(load_config(args.config, overrides), data=open_training_data(args.data, []))
            # the first interval includes warm-up
            speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
            rows.append(
                {
                    "name": name,
                    "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1],
                    "state_bytes": state["optimizer_state_bytes_rank0"],
                    "planned_bytes": planned["memory_per_gpu_bytes"]["optimizer"],
                    "tokens_per_s": sorted(speeds)[len(speeds) // 2] if speeds else float("nan"),
                    "implementation": state["optimizer"]["implementation"],
                }
            )
    base = next((r for r in rows if r["name"] == "adamw"), rows[0])
    print(
        f"| optimizer | final val loss | vs {base['name']} | within {TOLERANCE:.0%} | state bytes (measured) "
        f"| plan | "
        f"plan/measured | tokens/s (median) | implementation |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        delta = r["val_loss"] / base["val_loss"] - 1
        print(
            f"| {r['name']} | {r['val_loss']:.4f} | {delta:+.2%} | "
            f"{'yes' if abs(delta) <= TOLERANCE else 'NO'} | "
            f"{r['state_bytes']:,} | {r['planned_bytes']:,} | {r['planned_bytes'] / r['state_bytes']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['implementation']} |"
        )


if __name__ == "__main__":
    main()
