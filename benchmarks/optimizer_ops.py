"""Operators per optimizer step, counted with torch.profiler on CPU: a proxy for the kernel launches an
eager step costs on a GPU.

    python benchmarks/optimizer_ops.py [--config configs/gpt2-124m.toml] [--warmup 2] [--names
        muon,adamw,adamw-foreach] [--device cpu|cuda] [--time N] [--section.key=value ...]

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

On a GPU (--device cuda) each row also counts the CUDA kernels the step launched, and --time N times N
more steps between two synchronisations (milliseconds per step; the gradients stay as they are): what
gpu_checklist.py's muon_step stage reports against fused AdamW.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.model import Transformer
from pretrainer.optim.adamw import param_groups
from pretrainer.optim.registry import build_optimizer


def count_ops(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[int, int, int | None]:
    """(every aten:: event, the top-level ones, CUDA kernels or None off a GPU) of one optimizer.step()."""
    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu) as prof:
        optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = sum(e.device_type == DeviceType.CUDA for e in prof.events()) if on_gpu else None
    return len(aten), len(top), kernels


def step_ms(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Milliseconds per optimizer.step() over `steps` steps between two synchronisations."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    sync()
    return (time.perf_counter() - started) / steps * 1000


def random_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).mul_(1e-3).to(p.device)


def build(model: torch.nn.Module, cfg, name: str) -> torch.optim.Optimizer:
    if name == "adamw-foreach":
        o = cfg.optim
        groups = param_groups(model, o.weight_decay)
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    return build_optimizer(model, cfg.optim, next(model.parameters()).device.type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt2-124m.toml")
    parser.add_argument("--names", default="muon,adamw,adamw-foreach")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the one profiled")
    parser.add_argument("--device", default="cpu", help="where the model and the optimizer live")
    parser.add_argument("--time", type=int, default=0, help="also time this many steps (0: do not time)")
    args, overrides = parser.parse_known_args()
    device = torch.device(args.device)
    rows = []
    for name in args.names.split(","):
        optim = "adamw" if name == "adamw-foreach" else name
        cfg = resolve(load_config(args.config, [*overrides, f"--optim.name={optim}"]))
        flags = [None] if name == "adamw-foreach" else [None, "zero"]
        for flag in flags:
            torch.manual_seed(0)
            with torch.device(device):
                model = Transformer(cfg.model)
            optimizer = build(model, cfg, name)
            optimizer.found_inf = None if flag is None else torch.zeros((), device=device)
            for step in range(args.warmup):
                random_gradients(model, step)
                optimizer.step()
            random_gradients(model, args.warmup)
            aten, top, kernels = count_ops(optimizer, device)
            ms = step_ms(optimizer, args.time, device) if args.time else None
            parameters = sum(p.numel() for p in model.parameters())
            tensors = len(list(model.parameters()))
            flag_name = "None" if flag is None else "0-d tensor"
            rows.append((name, flag_name, parameters, tensors, aten, top, kernels, ms))
            del model, optimizer
    shape = " ".join([args.config, *overrides])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    steps = f"one step after {args.warmup} warm-up steps"
    print(f"`{shape}`, {where}, float32 weights, {steps} (torch {torch.__version__})")
    print()
    columns = ["top-level aten ops", "all aten ops", "CUDA kernels", "ms per step"]
    print(f"| optimizer | found_inf | parameters | tensors | {' | '.join(columns)} |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flag, parameters, tensors, aten, top, kernels, ms in rows:
        cells = [f"{kernels:,}" if kernels is not None else "-", f"{ms:.2f}" if ms is not None else "-"]
        print(f"| {name} | {flag} | {parameters:,} | {tensors} | {top:,} | {aten:,} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
