"""Time to quality against nanoGPT: at which fraction of nanoGPT's tokens does a pretrainer run first
reach nanoGPT's final validation loss? Same token files, same model shape, same batch, on CPU (or one
GPU: `--device cuda`, which benchmarks/gpu_checklist.py's vs_nanogpt stage runs at GPT-2 124M's width).

    python benchmarks/vs_nanogpt.py --data data/stdlib-bpe4k --nanogpt PATH_TO_NANOGPT_CHECKOUT
        [--sizes 128x4,192x6] [--horizons 200,400] [--evals 8] [--eval-batches 40]
        [--device cpu|cuda] [--cache FILE.json]
        [--optim.name=adamw ...]          # pretrainer's side: any config override (default: the defaults)

For each size (d_model x n_layer; 64-wide heads) and horizon H (optimizer steps of 16 x 256 tokens):

- nanoGPT (karpathy/nanoGPT, fetched by you: `git clone https://github.com/karpathy/nanoGPT`): its
  train.py, as a subprocess on our train/val token files, with its own hyper-parameters (lr 6e-4, min
  lr 6e-5, weight decay 0.1, betas 0.9/0.95, grad clip 1.0, cosine decay), the ones its comments tie
  to the horizon set to it (max_iters = lr_decay_iters = H, warmup_iters = H / 10 instead of 2,000,
  which a short run would never finish), bias on (our GPT-2 shape), dropout 0, no compile; float32 on
  CPU, bfloat16 on CUDA (its default there).
  Its validation loss every H / evals iterations over --eval-batches random val batches.
- pretrainer: `pretrainer train` with model.arch = gpt2 of the same shape, the same batch and H
  steps, and the config's defaults unless overridden on this command line; validation every
  H / evals steps over --eval-batches batches.

The table gives nanoGPT's final validation loss, ours at the same tokens, and the first point where
ours reaches nanoGPT's final loss, linearly interpolated between evaluations, as a fraction of
nanoGPT's tokens ("> 1" when it never does). The target this project states for its default recipe:
at most 0.75 at every size and horizon.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics

MICRO_BATCH, SEQ_LEN = 16, 256


def nanogpt_val_losses(
    checkout: Path,
    data: Path,
    vocab: int,
    d_model: int,
    n_layer: int,
    horizon: int,
    every: int,
    eval_batches: int,
    workdir: Path,
    device: str,
) -> dict[int, float]:
    """{iteration: val loss} of nanoGPT's train.py on our token files."""
    dataset = workdir / "data" / "pretrainer"
    dataset.mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(checkout / name, workdir / name)
    for split in ("train", "val"):
        (dataset / f"{split}.bin").symlink_to((data / f"{split}.bin").resolve())
    with open(dataset / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab}, f)  # else nanoGPT pads the vocabulary to 50,304
    settings = {
        "dataset": "pretrainer",
        "init_from": "scratch",
        "out_dir": str(workdir / "out"),
        "n_layer": n_layer,
        "n_head": d_model // 64,
        "n_embd": d_model,
        "block_size": SEQ_LEN,
        "bias": True,
        "dropout": 0.0,
        "batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "max_iters": horizon,
        "lr_decay_iters": horizon,
        "warmup_iters": horizon // 10,
        "eval_interval": every,
        "eval_iters": eval_batches,
        "log_interval": 50,
        "always_save_checkpoint": False,
        "wandb_log": False,
        "compile": False,
        "device": device,
        "dtype": "float32" if device == "cpu" else "bfloat16",
    }
    result = run_side(
        "nanoGPT",
        [sys.executable, "train.py", *[f"--{k}={v}" for k, v in settings.items()]],
        cwd=workdir,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    found = re.findall(r"^step (\d+): train loss \S+, val loss ([\d.]+)", result.stdout, re.MULTILINE)
    return {int(step): float(loss) for step, loss in found}


def pretrainer_val_losses(
    data: Path,
    d_model: int,
    n_layer: int,
    horizon: int,
    every: int,
    eval_batches: int,
    overrides: list[str],
    run: Path,
    device: str,
) -> dict[int, float]:
    args = [
        f"--data.dir={data}",
        f"--run.dir={run}",
        "--model.arch=gpt2",
        f"--model.d_model={d_model}",
        f"--model.n_layer={n_layer}",
        f"--model.n_head={d_model // 64}",
        f"--model.seq_len={SEQ_LEN}",
        "--model.norm_eps=1e-5",
        f"--train.micro_batch={MICRO_BATCH}",
        f"--train.max_steps={horizon}",
        f"--eval.every={every}",
        f"--eval.batches={eval_batches}",
        "--eval.tasks_every=0",
        f"--ckpt.every={horizon}",
        "--log.every=50",
        "--track.backends=none",
        f"--train.device={device}",
        *overrides,
    ]
    run_side("pretrainer", [sys.executable, "-m", "pretrainer", "train", *args])
    return {r["step"]: r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r}


class SideFailed(Exception):
    """One side's training process failed: its exit code and the end of what it printed."""

    def __init__(self, side: str, result: subprocess.CompletedProcess):
        tail = (result.stdout[-2500:] + "\n" + result.stderr[-2500:]).strip()
        super().__init__(
            f"{side} failed (exit {result.returncode}): {shlex.join(map(str, result.args))[:300]}\n{tail}"
        )


def run_side(side: str, command: list, **kwargs) -> subprocess.CompletedProcess:
    """One side's process (its output captured); SideFailed when it fails (also vs_nanochat.py's)."""
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SideFailed(side, result)
    return result


def first_reach(curve: dict[int, float], target: float) -> float | None:
    """The first step at which the curve reaches `target`, linearly interpolated between evaluations."""
    points = sorted(curve.items())
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= target:
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1) if l0 > target else float(s0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared data dir with uint16 tokens")
    parser.add_argument(
        "--nanogpt", required=True, help="a nanoGPT checkout (train.py, model.py, configurator.py)"
    )
    parser.add_argument("--sizes", default="128x4,192x6", help="d_model x n_layer, comma-separated")
    parser.add_argument("--horizons", default="200,400", help="optimizer steps, comma-separated")
    parser.add_argument("--evals", type=int, default=8, help="evaluations per run")
    parser.add_argument("--eval-batches", type=int, default=40)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both train")
    parser.add_argument(
        "--cache",
        help="a JSON file of nanoGPT's curves, read and extended: nanoGPT runs once per size, horizon and "
        "evaluation setting while pretrainer's side is varied",
    )
    args, overrides = parser.parse_known_args()
    import json

    data = Path(args.data)
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    print(f"pretrainer overrides: {' '.join(overrides) or '(none: the defaults)'}")
    print(
        "| size | steps | tokens | nanoGPT final val loss | ours at the same tokens | fraction of nanoGPT's "
        "tokens to reach it |"
    )
    print("|---|---|---|---|---|---|")
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            d_model, n_layer = (int(x) for x in size.split("x"))
            for horizon in (int(h) for h in args.horizons.split(",")):
                every = horizon // args.evals
                work = Path(tmp) / f"{size}-{horizon}"
                key = f"{data.resolve()} {size} {horizon} {every} {args.eval_batches} {args.device}"
                if key not in cache:
                    cache[key] = nanogpt_val_losses(
                        Path(args.nanogpt),
                        data,
                        vocab,
                        d_model,
                        n_layer,
                        horizon,
                        every,
                        args.eval_batches,
                        work / "nanogpt",
                        args.device,
                    )
                    if args.cache:
                        Path(args.cache).write_text(json.dumps(cache, indent=1))
                theirs = {int(step): loss for step, loss in cache[key].items()}
                ours = pretrainer_val_losses(
                    data,
                    d_model,
                    n_layer,
                    horizon,
                    every,
                    args.eval_batches,
                    overrides,
                    work / "ours",
                    args.device,
                )
                target = theirs[max(theirs)]
                reached = first_reach(ours, target)
                fraction = f"{reached / horizon:.2f}" if reached is not None else "> 1"
                print(
                    f"| {size} | {horizon} | {horizon * MICRO_BATCH * SEQ_LEN:,} | {target:.4f} | "
                    f"{ours[max(ours)]:.4f} | {fraction} |",
                    flush=True,
                )


if __name__ == "__main__":
    try:
        main()
    except SideFailed as e:  # what the failing side printed, not only that it failed
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
