"""Peak host memory per rank when N ranks resume from a checkpoint (CPU, gloo), against the same
ranks starting fresh: the difference is what resuming costs each rank.

    python benchmarks/resume_memory.py --data DATA_DIR [--nproc 2] [--d-model 768 --n-layer 8]

Trains one step single-process to write a checkpoint, then runs `torchrun` twice (fresh, resume)
for one more step and samples each worker's VmHWM (peak resident set) from /proc.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak_rss_per_rank(cmd: list[str], env: dict) -> list[float]:
    """Run cmd (torchrun) and return the workers' peak RSS in GB, sampled until they exit."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    while proc.poll() is None:
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
                cmdline = (status.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                b"pretrainer" in cmdline
                and b"torch.distributed.run" not in cmdline
                and int(status.parent.name) != os.getpid()
            ):
                fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                if int(fields.get("PPid", "0").strip()) != proc.pid:
                    continue  # only torchrun's children: the workers
                peaks[int(status.parent.name)] = int(fields["VmHWM"].split()[0]) / 1e6
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.read()[-3000:])
    return [peaks[pid] for pid in sorted(peaks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            f"--data.dir={args.data}",
            f"--model.d_model={args.d_model}",
            f"--model.n_layer={args.n_layer}",
            "--model.n_head=12",
            "--model.seq_len=128",
            "--train.micro_batch=2",
            "--eval.every=0",
            "--eval.batches=1",
            "--log.every=1",
            "--track.backends=none",
            f"--parallel.strategy={args.strategy}",
            "--train.max_steps=3",
        ]
        run = Path(tmp) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pretrainer",
                "train",
                *common,
                f"--run.dir={run}",
                "--train.stop_at_step=1",
                "--train.grad_accum=2",
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        size = sum(f.stat().st_size for f in next((run / "checkpoints").iterdir()).iterdir())
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            "-m",
            "pretrainer",
            "train",
            *common,
            "--train.stop_at_step=2",
        ]
        fresh = peak_rss_per_rank([*torchrun, f"--run.dir={Path(tmp) / 'fresh'}"], env)
        resumed = peak_rss_per_rank([*torchrun, f"--run.dir={run}"], env)
    print(f"checkpoint: {size / 1e9:.2f} GB; {args.nproc} ranks, {args.strategy}")
    for rank, (a, b) in enumerate(zip(fresh, resumed)):
        print(
            f"rank {rank}: peak RSS fresh {a:.2f} GB, resuming {b:.2f} GB (+{b - a:.2f} GB, "
            f"{(b - a) * 1e9 / size:.2f} x the checkpoint)"
        )


if __name__ == "__main__":
    main()
