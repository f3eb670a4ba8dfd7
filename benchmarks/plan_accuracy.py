"""How far `plan --measure` is from the run it predicts: for each config, the plan (a short probe in its
own process) and then the real run (its own process; wall time from its metrics, peak RSS from wait4),
one after the other on a quiet machine.

    python benchmarks/plan_accuracy.py --data-dir data/stdlib-bpe4k [--probe-steps 30]

Prints a markdown table: config, parameters, steps, predicted and real wall time and peak memory, errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# three sizes of the quickstart's shape: (name, overrides, steps)
SIZES = [
    (
        "small (d64 x 2)",
        ["--model.d_model=64", "--model.n_layer=2", "--model.n_head=4", "--model.n_kv_head=2"],
        300,
    ),
    ("tiny-cpu (d128 x 4)", [], 300),
    (
        "medium (d192 x 6)",
        ["--model.d_model=192", "--model.n_layer=6", "--model.n_head=6", "--model.n_kv_head=2"],
        200,
    ),
]


def pretrainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretrainer", *args]


def real_run(config: list[str], run_dir: Path) -> tuple[float, int]:
    """-> (the run's wall time from its metrics, its peak RSS in bytes)."""
    with open(run_dir.parent / "train.log", "w") as log:
        process = subprocess.Popen(
            pretrainer("train", *config, f"--run.dir={run_dir}"), stdout=log, stderr=log
        )
        # wait4's peak also holds this launcher's (folded in at exec): this script imports no torch (~10 MB)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the real run failed: see {run_dir.parent / 'train.log'}")
    elapsed = [
        json.loads(line).get("elapsed_s") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return max(e for e in elapsed if e is not None), usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--probe-steps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for name, overrides, steps in SIZES:
        config = [
            "configs/tiny-cpu.toml",
            f"--data.dir={args.data_dir}",
            f"--train.max_steps={steps}",
            "--track.backends=none",
            *overrides,
        ]
        planned = subprocess.run(
            pretrainer("plan", *config, "--measure", "--measure-steps", str(args.probe_steps), "--json"),
            capture_output=True,
            text=True,
            check=True,
        )
        plan = json.loads(planned.stdout)
        with tempfile.TemporaryDirectory() as tmp:
            wall_s, rss = real_run(config, Path(tmp) / "run")
        predicted_s, predicted_rss = plan["wall_hours"] * 3600, plan["measured"]["peak_memory_bytes"]
        rows.append(
            f"| {name} | {plan['params_total']:,} | {steps} | {predicted_s:.1f} s | {wall_s:.1f} s | "
            f"{predicted_s / wall_s - 1:+.1%} | {predicted_rss / 2**30:.2f} GiB | {rss / 2**30:.2f} GiB | "
            f"{predicted_rss / rss - 1:+.1%} |"
        )
        print(rows[-1], flush=True)
    print(
        "\n| config | parameters | steps | plan --measure | real run | error | planned peak | real peak "
        "| error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
