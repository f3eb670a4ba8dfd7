"""What checkpoint integrity costs: save (with the sha256 of every file), verify, and verify + load,
for a real model shape with its AdamW state, on this machine's CPU and disk.

    python benchmarks/checkpoint_verify.py configs/gpt2-124m.toml [--dir /fast/disk]

Prints bytes, seconds and GB/s for each phase, and the same extrapolated by size to another
config (default configs/llama3-1b.toml), since verification is linear in bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pretrainer.artifacts.checkpoint import model_weights, read_intact, save_checkpoint, verify_checkpoint
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.model import Transformer, count_parameters
from pretrainer.optim.registry import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--extrapolate-to", default="configs/llama3-1b.toml")
    args = parser.parse_args()
    cfg = resolve(load_config(args.config), horizon=False)  # the shape only
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    # one step with zero gradients: the AdamW moments exist, as in a real checkpoint
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        started = time.perf_counter()
        path = save_checkpoint(
            Path(tmp), 1, model_weights(model), optimizer.state_dict(), {"step": 1}, keep=2
        )
        save_s = time.perf_counter() - started
        size = sum(f.stat().st_size for f in path.iterdir())
        started = time.perf_counter()
        assert verify_checkpoint(path) == ""
        verify_s = time.perf_counter() - started
        started = time.perf_counter()
        read_intact(path)
        read_s = time.perf_counter() - started
    params = count_parameters(model)["total"]
    print(f"{args.config}: {params:,} parameters, checkpoint {size / 1e9:.2f} GB (weights + AdamW state)")
    print(
        f"save incl. sha256: {save_s:.2f} s | verify (sha256 of every file): {verify_s:.2f} s "
        f"({size / 1e9 / verify_s:.2f} GB/s) "
        f"| verify + load: {read_s:.2f} s"
    )
    with torch.device("meta"):
        other = count_parameters(Transformer(resolve(load_config(args.extrapolate_to), horizon=False).model))[
            "total"
        ]
    print(
        f"extrapolated to {args.extrapolate_to} ({other:,} parameters, ~{size * other / params / 1e9:.1f} "
        f"GB): "
        f"verify ~{verify_s * other / params:.0f} s on this machine"
    )


if __name__ == "__main__":
    main()
