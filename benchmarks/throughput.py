"""Training throughput: pretrainer's trainer against a bare PyTorch loop over the same model (and,
optionally, nanoGPT on the same shape and tokens), all in one process: tokens/s, MFU where the
device's peak is known, peak memory, and the trainer's speed as a fraction of the bare loop's.

    python benchmarks/throughput.py configs/gpt2-124m.toml --data DATA_DIR [--steps 50] [--warmup 10]
        [--variants config,eager,compile,ac,no-ac,sdpa-flash,sdpa-efficient,sdpa-math,sdpa-cudnn]
        [--micro-batches 4,8,16] [--repeats 3] [--nanogpt PATH_TO_NANOGPT_CHECKOUT] [--out results.json]
        [--model.n_layer=6 ...]                              # any config override
    python benchmarks/throughput.py --smoke --data DATA_DIR  # tiny shape, every path once, ~15 s on 2 CPU
    cores

Every (variant, micro-batch) is measured by each loop, alternating (bare, pretrainer, nanoGPT, bare,
...) --repeats times; the table shows the median and the spread ((max - min) / median).

- bare loop: the same Transformer, fused AdamW, SequenceLoader micro-batches, autocast, grad clipping
  and torch.compile setting as the config, and nothing else. W warm-up steps, a device synchronize,
  N timed steps, a synchronize: tokens/s = N x tokens per step / seconds.
- pretrainer: `train(cfg)` in this process into a temp run dir with max_steps = W + N, eval.every = 0
  and ckpt.every = 0 (so validation and the one checkpoint come before step 1 and after step W + N),
  trackers off (--track.backends=mlflow to include mlflow). tokens/s = the metrics.jsonl records after step W:
  their tokens over the time they cover. log.every stays as configured (10 by default) and W is
  rounded up to a multiple of it, so the window starts on a logging step and the trainer pays its
  real logging cost inside it (its clock is read after the logging step's sync).
- nanoGPT (--nanogpt): its train.py as a subprocess in a temp dir whose data/pretrainer/{train,val}.bin
  link to our token files (uint16 only) and whose meta.pkl gives our vocab size; the shape must be
  GPT-2's (model.arch = gpt2, d_ff = 4 x d_model, tied embeddings). tokens/s = N x batch_size x
  block_size x gradient_accumulation_steps / the sum of its "time X ms" for iterations W .. W+N-1.
  Rows with activation checkpointing or a forced attention backend have no nanoGPT counterpart.
  Differences that remain: nanoGPT's GELU is exact (ours tanh), its AdamW is fused on CUDA only, it
  turns TF32 matmuls on, pins its batches, and syncs on the loss every iteration (log_interval = 1).

Variants: config (as the TOML says), eager / compile (train.compile), ac / no-ac
(train.activation_checkpointing), sdpa-flash / sdpa-efficient / sdpa-math / sdpa-cudnn (every loop
runs inside torch.nn.attention.sdpa_kernel; a backend this device cannot run is skipped with a note);
combine with '+', e.g. compile+sdpa-math. Peak memory: CUDA max_memory_allocated on GPU; on CPU the
process's peak RSS since the run started (Linux: VmHWM, reset through /proc/self/clear_refs).
Exit code 1 if any run failed (an out-of-memory micro-batch included), 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.artifacts.runs import build_model
from pretrainer.cli.main import join_dotted_overrides
from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve, tokens_per_step
from pretrainer.config.schema import Config
from pretrainer.core.device import autocast, autocast_dtype, compiles, device_peak_tflops, resolve_device
from pretrainer.core.errors import UserError
from pretrainer.core.hardware import mfu
from pretrainer.data.data_dir import DataDir, open_data_dir
from pretrainer.data.loader import SequenceLoader
from pretrainer.model import Transformer, count_parameters
from pretrainer.model.flops import flops_per_token
from pretrainer.optim.registry import build_optimizer
from pretrainer.train.loop import train

CONFIG_VARIANTS = {
    "config": [],
    "eager": ["--train.compile=false"],
    "compile": ["--train.compile=true"],
    "ac": ["--train.activation_checkpointing=true"],
    "no-ac": ["--train.activation_checkpointing=false"],
}
SDPA_VARIANTS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-math": SDPBackend.MATH,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
}

# --smoke: a d_model-32, 2-layer model, a handful of steps; every loop and kind of variant once. No
# compile: a cold inductor cache takes about a minute to compile even this model on 2 CPU cores.
SMOKE_OVERRIDES = [
    "--model.d_model=32",
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_kv_head=0",
    "--model.seq_len=32",
    "--train.grad_accum=1",
    "--train.compile=false",
    "--log.every=2",
]
SMOKE_SETTINGS = {
    "steps": 4,
    "warmup": 2,
    "repeats": 1,
    "variants": "config,ac+sdpa-math,sdpa-efficient",
    "micro_batches": "2,4",
}
# without --smoke
SETTINGS = {"steps": 50, "warmup": 10, "repeats": 3, "variants": "config", "micro_batches": ""}

LOOPS = ("bare loop", "pretrainer", "nanoGPT")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- peak memory of one run ---


class PeakMemory:
    """CUDA: max_memory_allocated. CPU: peak RSS, restarted for each run through /proc/self/clear_refs
    (Linux); where that cannot be written, the process's peak since it started."""

    def __init__(self, device: torch.device):
        self.device, self.resettable = device, True

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # restarts VmHWM from the current RSS
        except OSError:
            self.resettable = False

    def read(self) -> tuple[int, str]:
        """-> (bytes, what they measure)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), "CUDA allocated"
        if self.resettable:
            with contextlib.suppress(OSError, StopIteration):
                line = next(
                    row
                    for row in Path("/proc/self/status").read_text().splitlines()
                    if row.startswith("VmHWM")
                )
                return int(line.split()[1]) * 1024, "RSS"
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "RSS since start"


def fresh_state(device: torch.device, memory: PeakMemory) -> None:
    """Before each run: no memory, compiled graphs or dynamic-shape guesses left over from the last one
    (a second micro-batch would otherwise recompile with a dynamic batch dimension)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    memory.reset()


# --- the three loops; each returns (tokens/s, peak memory bytes or None, what the memory measures) ---


def bare_loop(
    cfg: Config, data: DataDir, device: torch.device, memory: PeakMemory, warmup: int, steps: int
) -> tuple[float, int, str]:
    """The plain PyTorch loop the trainer is measured against: the same model, optimizer, batches,
    autocast, clipping and compile setting; no logging, guards, metrics or checkpoints."""
    amp_dtype = autocast_dtype(cfg.train.dtype, device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg).to(device)
    compiled = compiles(cfg.train.compile, device)
    model.configure_blocks(cfg.train.activation_checkpointing, compiled)  # as the trainer does
    optimizer = build_optimizer(model, cfg.optim, device.type, compile_step=compiled)
    forward = model
    loader = SequenceLoader(
        data.tokens("train"),
        cfg.model.seq_len,
        cfg.train.micro_batch,
        cfg.train.grad_accum,
        seed=cfg.train.seed,
    )

    def one_step() -> None:
        for x, y in loader.next_step():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, amp_dtype):
                _, loss = forward(x, y)
            (loss / cfg.train.grad_accum).backward()
        if cfg.train.grad_clip > 0:  # part of the recipe (nanoGPT clips too), not trainer overhead
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        one_step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        one_step()
    synchronize(device)
    seconds = time.perf_counter() - started
    return steps * tokens_per_step(cfg, 1) / seconds, *memory.read()


def pretrainer_loop(
    args,
    overrides: list[str],
    device: torch.device,
    memory: PeakMemory,
    warmup: int,
    steps: int,
    run_dir: Path,
) -> tuple[float, int, str]:
    """The real trainer, in this process; tokens/s from the metrics.jsonl records after the warm-up."""
    cfg = load_config(
        args.config,
        [
            "--track.backends=none",
            *overrides,  # --track.backends=mlflow measures its cost too
            f"--run.dir={run_dir}",
            f"--train.max_steps={warmup + steps}",
            "--train.stop_at_step=0",
            "--train.resume=never",
            "--eval.every=0",
            "--eval.batches=1",
            "--ckpt.every=0",
        ],
    )
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            train(cfg)
        except Exception:
            traceback.print_exc(file=out)
            out.flush()
            raise RuntimeError(f"pretrainer failed; its output ends with:\n{tail(log)}") from None
    peak = memory.read()
    records = sorted(
        (r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r), key=lambda r: r["step"]
    )
    steps_logged = [r["step"] for r in records]
    if warmup not in steps_logged or steps_logged[-1] != warmup + steps:
        raise RuntimeError(
            f"{run_dir}/metrics.jsonl: expected records at steps {warmup} and {warmup + steps}, "
            f"got {steps_logged}"
        )
    timed = [
        (previous, record) for previous, record in itertools.pairwise(records) if record["step"] > warmup
    ]
    tokens = sum(record["tokens"] - previous["tokens"] for previous, record in timed)
    seconds = sum(
        (record["tokens"] - previous["tokens"]) / record["tokens_per_s"] for previous, record in timed
    )
    shutil.rmtree(run_dir)  # the final checkpoint: a 124M model's is 1.5 GB
    return tokens / seconds, *peak


def nanogpt_problem(cfg: Config, data: DataDir) -> str:
    """'' when nanoGPT can train this exact shape on these token files, else why not."""
    m = cfg.model
    if data.manifest["dtype"] != "uint16":
        return (
            f"{data.path}: tokens are {data.manifest['dtype']}, but nanoGPT's train.py reads uint16 "
            f"(a vocab over 65,536 cannot be compared)"
        )
    problems = [
        text
        for wrong, text in [
            (
                m.arch != "gpt2",
                "--model.arch=gpt2 (nanoGPT is GPT-2: LayerNorm, GELU, learned positions, biases)",
            ),
            (m.d_ff != 4 * m.d_model, f"--model.d_ff=0 (nanoGPT's MLP is 4 x d_model = {4 * m.d_model})"),
            (not m.tie_embeddings, "--model.tie_embeddings=true (nanoGPT ties wte and lm_head)"),
            (m.norm_eps != 1e-5, "--model.norm_eps=1e-5 (nanoGPT's LayerNorm eps)"),
        ]
        if wrong
    ]
    return f"--nanogpt needs the same shape; set {', '.join(problems)}" if problems else ""


def nanogpt_overrides(cfg: Config, device: torch.device, warmup: int, steps: int) -> list[str]:
    """nanoGPT's train.py settings for the same shape, batch and precision; nothing saved, one eval of
    one batch at iteration 0 (before the timed window), a log line (and a loss sync) every iteration."""
    m, t = cfg.model, cfg.train
    settings = {
        "dataset": "pretrainer",
        "init_from": "scratch",
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_embd": m.d_model,
        "block_size": m.seq_len,
        "bias": True,
        "dropout": 0.0,
        "batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "max_iters": warmup + steps - 1,  # iterations 0 .. max_iters
        "eval_interval": warmup + steps + 1,
        "eval_iters": 1,
        "log_interval": 1,
        "always_save_checkpoint": False,
        "wandb_log": False,
        "compile": compiles(t.compile, device),
        "device": str(device),
        "dtype": "bfloat16" if autocast_dtype(t.dtype, device) else "float32",
        "grad_clip": float(t.grad_clip),
    }
    return [f"--{key}={value}" for key, value in settings.items()]


def nanogpt_loop(
    checkout: Path, cfg: Config, data: DataDir, device: torch.device, warmup: int, steps: int, workdir: Path
) -> tuple[float, int | None, str]:
    if not workdir.exists():  # nanoGPT reads data/<dataset>/{train,val}.bin and meta.pkl relative to its cwd
        dataset = workdir / "data" / "pretrainer"
        dataset.mkdir(parents=True)
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(checkout / name, workdir / name)
        for split in ("train", "val"):  # one file each, as nanoGPT reads it (a split's shards joined)
            np.asarray(data.tokens(split)).tofile(dataset / f"{split}.bin")
        with open(dataset / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": cfg.model.vocab_size}, f)  # else nanoGPT pads the vocab to 50304
    log = workdir / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *nanogpt_overrides(cfg, device, warmup, steps)],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
        )  # as many as ours
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"nanoGPT exited with {proc.returncode}; its output ends with:\n{tail(log)}")
    times_ms = {
        int(i): float(ms)
        for i, ms in re.findall(r"^iter (\d+): loss \S+, time ([\d.]+)ms", text, re.MULTILINE)
    }
    missing = [i for i in range(warmup, warmup + steps) if i not in times_ms]
    if missing:
        raise RuntimeError(
            f"nanoGPT printed no 'iter N: ... time X ms' line for iterations {missing[:5]}; "
            f"output:\n{tail(log)}"
        )
    seconds = sum(times_ms[i] for i in range(warmup, warmup + steps)) / 1000
    # its GPU memory is not visible here
    memory = (usage.ru_maxrss * 1024, "RSS") if device.type == "cpu" else (None, "")
    return steps * tokens_per_step(cfg, 1) / seconds, *memory


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- variants ---


def parse_variant(name: str) -> tuple[list[str], SDPBackend | None]:
    """'compile+sdpa-math' -> (config overrides, attention backend or None)."""
    overrides, backend = [], None
    for part in name.split("+"):
        if part in CONFIG_VARIANTS:
            overrides += CONFIG_VARIANTS[part]
        elif part in SDPA_VARIANTS:
            backend = SDPA_VARIANTS[part]
        else:
            raise UserError(
                f"--variants: unknown variant '{part}'; use {', '.join([*CONFIG_VARIANTS, *SDPA_VARIANTS])}, "
                f"combined with '+'"
            )
    return overrides, backend


def backend_problem(backend: SDPBackend, cfg: Config, device: torch.device) -> str:
    """'' when this attention backend runs forward and backward for the model's heads on this device."""
    dtype = autocast_dtype(cfg.train.dtype, device) or torch.float32
    q = torch.randn(
        1,
        cfg.model.n_head,
        cfg.model.seq_len,
        cfg.model.d_model // cfg.model.n_head,
        device=device,
        dtype=dtype,
        requires_grad=True,
    )
    try:
        with warnings.catch_warnings(), sdpa_kernel(backend):
            # torch explains each missing kernel in a warning; the error says enough
            warnings.simplefilter("ignore")
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as e:
        return f"{backend.name} not available on {device.type} for {dtype} ({str(e).splitlines()[0]})"
    return ""


# --- the sweep ---


def measure_row(
    args,
    base_overrides: list[str],
    variant: str,
    micro_batch: int,
    data: DataDir,
    tmp: Path,
    warmup: int,
    steps: int,
) -> list[dict]:
    """All loops on one (variant, micro-batch), alternating, args.repeats times -> one result per loop."""
    variant_overrides, backend = parse_variant(variant)
    overrides = [*base_overrides, *variant_overrides, f"--train.micro_batch={micro_batch}"]
    cfg = resolve(load_config(args.config, overrides), 1, data, horizon=False)  # its own steps
    device = resolve_device(cfg.train.device)
    with torch.device("meta"):
        non_embedding = count_parameters(Transformer(cfg.model))["non_embedding"]
    model_flops = flops_per_token(cfg.model, non_embedding)["total"]
    peak_tflops = device_peak_tflops(cfg.budget.peak_tflops, device)
    results = {
        loop: {"loop": loop, "variant": variant, "micro_batch": micro_batch, "runs": [], "note": ""}
        for loop in LOOPS
    }
    if not args.nanogpt:
        del results["nanoGPT"]
    elif cfg.train.activation_checkpointing or backend is not None:
        results["nanoGPT"]["note"] = (
            "no nanoGPT counterpart (activation checkpointing or a forced attention backend)"
        )
    skipped = backend_problem(backend, cfg, device) if backend is not None else ""
    for result in results.values():
        result["note"] = result["note"] or skipped
    row_id, memory = f"{variant}-mb{micro_batch}", PeakMemory(device)
    for repeat in range(args.repeats):
        for loop, result in results.items():
            if result["note"]:
                continue
            fresh_state(device, memory)
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    if loop == "bare loop":
                        measured = bare_loop(cfg, data, device, memory, warmup, steps)
                    elif loop == "pretrainer":
                        measured = pretrainer_loop(
                            args, overrides, device, memory, warmup, steps, tmp / f"run-{row_id}-{repeat}"
                        )
                    else:
                        measured = nanogpt_loop(
                            Path(args.nanogpt), cfg, data, device, warmup, steps, tmp / f"nanogpt-{row_id}"
                        )
            except Exception as e:  # an OOM at one micro-batch should not lose the rest of the sweep
                result["error"] = (
                    "out of memory"
                    if isinstance(e, torch.cuda.OutOfMemoryError)
                    else f"{type(e).__name__}: {e}"
                )
                print(
                    f"{loop}, {variant}, micro-batch {micro_batch}: FAILED: {result['error']}",
                    file=sys.stderr,
                )
                result["note"] = "failed"
                continue
            tokens_per_s, peak_bytes, memory_kind = measured
            result["runs"].append(tokens_per_s)
            result["peak_memory_bytes"] = max(result.get("peak_memory_bytes") or 0, peak_bytes or 0) or None
            result["memory_kind"] = memory_kind
            print(
                f"  {loop}, {variant}, micro-batch {micro_batch}, repeat {repeat + 1}: {tokens_per_s:,.0f} "
                f"tokens/s",
                file=sys.stderr,
                flush=True,
            )
    bare = statistics.median(results["bare loop"]["runs"]) if results["bare loop"]["runs"] else None
    for result in results.values():
        runs = result["runs"]
        result["tokens_per_s"] = statistics.median(runs) if runs else None
        result["spread"] = (max(runs) - min(runs)) / statistics.median(runs) if len(runs) > 1 else None
        result["mfu"] = (
            mfu(model_flops, result["tokens_per_s"], peak_tflops, 1) if runs and peak_tflops else None
        )
        result["vs_bare_loop"] = result["tokens_per_s"] / bare if runs and bare else None
    return list(results.values())


def format_table(rows: list[dict]) -> str:
    def memory(row):
        size = row.get("peak_memory_bytes")
        return f"{size / 2**30:.2f} GiB {row['memory_kind']}" if size else "n/a"

    lines = [
        "| loop | variant | micro-batch | tokens/s | spread | MFU | peak memory | vs bare loop |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in rows:
        measured = row["tokens_per_s"] is not None
        lines.append(
            " | ".join(
                [
                    f"| {row['loop']}",
                    row["variant"],
                    str(row["micro_batch"]),
                    f"{row['tokens_per_s']:,.0f}"
                    if measured
                    else "FAILED"
                    if row.get("error")
                    else "skipped",
                    f"{row['spread']:.1%}" if row["spread"] is not None else "-",
                    f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a",
                    memory(row),
                    f"{row['vs_bare_loop']:.3f}" if row["vs_bare_loop"] is not None else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    """The trainer against the bare loop (target >= 0.97) and against nanoGPT, row by row."""
    lines, by_row = [], {}
    for row in rows:
        by_row.setdefault((row["variant"], row["micro_batch"]), {})[row["loop"]] = row
    for (variant, micro_batch), loops in by_row.items():
        ours = loops["pretrainer"]["tokens_per_s"]
        if ours is None:
            continue
        ratio = loops["pretrainer"]["vs_bare_loop"]
        if ratio is None:
            continue
        line = (
            f"{variant}, micro-batch {micro_batch}: pretrainer / bare loop {ratio:.3f} "
            f"({'meets' if ratio >= 0.97 else 'BELOW'} the 0.97 target)"
        )
        nanogpt = loops.get("nanoGPT", {}).get("tokens_per_s")
        if nanogpt:
            line += f"; pretrainer / nanoGPT {ours / nanogpt:.3f}"
        lines.append(line)
    skipped: dict[tuple, list[str]] = {}
    for row in rows:
        if row["note"] and row["note"] != "failed":
            skipped.setdefault((row["variant"], row["micro_batch"], row["note"]), []).append(row["loop"])
    for (variant, micro_batch, note), loops in skipped.items():
        lines.append(f"note: {variant}, micro-batch {micro_batch}, {' and '.join(loops)} skipped: {note}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="TOML config (default: the built-in defaults)")
    parser.add_argument("--data", required=True, help="a directory written by `pretrainer prepare`")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run (default 50)")
    parser.add_argument(
        "--warmup", type=int, help="untimed steps first (default 10, rounded up to a multiple of log.every)"
    )
    parser.add_argument(
        "--repeats", type=int, help="runs of each loop per row, alternating; the median is shown (default 3)"
    )
    parser.add_argument(
        "--variants",
        help="comma-separated (default: config): " + ", ".join([*CONFIG_VARIANTS, *SDPA_VARIANTS]),
    )
    parser.add_argument("--micro-batches", help="comma-separated (default: the config's train.micro_batch)")
    parser.add_argument(
        "--nanogpt", help="a nanoGPT checkout (train.py, model.py, configurator.py) to run on the same shape"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model, few steps, every path once (for CI)"
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    args, overrides = parser.parse_known_args(join_dotted_overrides(sys.argv[1:]))
    for key, value in (SMOKE_SETTINGS if args.smoke else SETTINGS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        # a tiny model gains nothing from threads, and they spin badly on a busy CI machine
        torch.set_num_threads(1)
        overrides = [*SMOKE_OVERRIDES, *overrides]
    overrides = [*overrides, f"--data.dir={args.data}"]
    try:
        base = load_config(args.config, overrides)
        data = open_data_dir(args.data)
        micro_batches = (
            [int(b) for b in args.micro_batches.split(",")]
            if args.micro_batches
            else [base.train.micro_batch]
        )
        if 0 in micro_batches:
            raise UserError("train.micro_batch = auto is not measured; pass --micro-batches 8,16")
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        for variant in variants:
            parse_variant(variant)
        if args.nanogpt:
            missing = [
                name
                for name in ("train.py", "model.py", "configurator.py")
                if not (Path(args.nanogpt) / name).is_file()
            ]
            if missing:
                raise UserError(f"--nanogpt {args.nanogpt}: not a nanoGPT checkout (no {', '.join(missing)})")
            problem = nanogpt_problem(resolve(base, 1, data, horizon=False), data)
            if problem:
                raise UserError(problem)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the trainer's window starts on a logging step
    warmup = math.ceil(max(args.warmup, 1) / base.log.every) * base.log.every
    device = resolve_device(base.train.device)
    hardware = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    print(
        f"{args.config or 'default config'} on {data.path}, {device} "
        f"({hardware}), "
        f"torch {torch.__version__}: {warmup} warm-up + {args.steps} timed steps, {args.repeats} repeats, "
        f"log.every {base.log.every}",
        flush=True,
    )

    started, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        for variant in variants:
            for micro_batch in micro_batches:
                rows += measure_row(
                    args, overrides, variant, micro_batch, data, Path(tmp), warmup, args.steps
                )
    print()
    print(format_table(rows))
    print()
    print("\n".join(summary(rows)))
    failed = [row for row in rows if row.get("error")]
    print(f"{len(rows)} rows in {time.time() - started:.1f}s" + (f"; {len(failed)} FAILED" if failed else ""))
    if args.out:
        settings = {
            "config": args.config,
            "data": str(data.path),
            "overrides": overrides,
            "warmup": warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "device": str(device),
            "torch": torch.__version__,
            "nanogpt": args.nanogpt,
        }
        Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    smoke_broken = args.smoke and any(
        row["tokens_per_s"] is not None and not row["tokens_per_s"] > 0 for row in rows
    )
    return 1 if failed or smoke_broken else 0


if __name__ == "__main__":
    sys.exit(main())
