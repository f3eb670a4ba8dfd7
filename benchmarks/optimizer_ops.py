"""Operators per optimizer step, counted with torch.profiler on CPU: a proxy for the kernel launches an
eager step costs on a GPU.

    python benchmarks/optimizer_ops.py [--config configs/gpt2-124m.toml] [--warmup 2] [--names
        muon,adamw,adamw-foreach] [--section.key=value ...]

Builds the config's model (through the config loader, resolve and build_optimizer; CPU, float32, full
size; --section.key=value arguments override the config), gives every parameter a random gradient,
takes --warmup steps (the optimizer's state exists after them), then profiles one more
`optimizer.step()`. Two counts per row:
- top-level: the `aten::` events with no `aten::` event above them, i.e. the operators the step's
  Python calls (each launches at most a kernel or a few on a GPU; views launch none). Fused AdamW's
  step is 8 of them with found_inf set.
- all: every profiler event whose name starts with `aten::`, the ones an operator calls inside itself
  included (on CPU a `_foreach_*` op calls its per-tensor op once per tensor, `unbind` a `select` per
  piece, a view an `as_strided`, fused AdamW a handful per tensor): an upper bound.
Each optimizer runs without `optimizer.found_inf` (None: every step kept) and with it set to a 0-d
zero, as the training loop always sets it (the spike monitor's skip flag: train/loop.py); a skipped
step (found_inf = 1) issues the same operators. `adamw` is the fused torch.optim.AdamW that
build_optimizer makes (it reads found_inf); `adamw-foreach` is torch.optim.AdamW(foreach=True), which
takes no found_inf: it has the None row only.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.model import Transformer
from pretrainer.optim.adamw import build_optimizer, param_groups


def count_ops(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(every aten:: event, the top-level ones) of one optimizer.step()."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(aten), len(top)


def random_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).mul_(1e-3)


def build(model: torch.nn.Module, cfg, name: str) -> torch.optim.Optimizer:
    if name == "adamw-foreach":
        o = cfg.optim
        groups = param_groups(model, o.weight_decay)
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    return build_optimizer(model, cfg.optim, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt2-124m.toml")
    parser.add_argument("--names", default="muon,adamw,adamw-foreach")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the one profiled")
    args, overrides = parser.parse_known_args()
    rows = []
    for name in args.names.split(","):
        optim = "adamw" if name == "adamw-foreach" else name
        cfg = resolve(load_config(args.config, [*overrides, f"--optim.name={optim}"]))
        flags = [None] if name == "adamw-foreach" else [None, "zero"]
        for flag in flags:
            torch.manual_seed(0)
            model = Transformer(cfg.model)
            optimizer = build(model, cfg, name)
            optimizer.found_inf = None if flag is None else torch.zeros(())
            for step in range(args.warmup):
                random_gradients(model, step)
                optimizer.step()
            random_gradients(model, args.warmup)
            aten, top = count_ops(optimizer)
            parameters = sum(p.numel() for p in model.parameters())
            tensors = len(list(model.parameters()))
            rows.append((name, "None" if flag is None else "0-d tensor", parameters, tensors, aten, top))
            del model, optimizer
    shape = " ".join([args.config, *overrides])
    print(f"`{shape}`, CPU, float32, one step after {args.warmup} warm-up steps (torch {torch.__version__})")
    print()
    print("| optimizer | found_inf | parameters | tensors | top-level aten ops | all aten ops |")
    print("|---|---|---|---|---|---|")
    for name, flag, parameters, tensors, aten, top in rows:
        print(f"| {name} | {flag} | {parameters:,} | {tensors} | {top:,} | {aten:,} |")


if __name__ == "__main__":
    main()
