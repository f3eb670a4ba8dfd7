"""The GPU checks, in stages that each fit one lent machine's call (< 10 minutes), for whoever gets a
GPU. Every stage's result goes into one JSON (merged by stage, so stages can run in separate calls);
--write appends its table to docs/benchmarks.md with the GPU, the torch version and the date. The first
call on a bare node runs them through benchmarks/gpu_first_call.sh (offline install, data, a deadline).

    python benchmarks/gpu_checklist.py --data DATA_DIR [--stages a,b] [--out FILE.json] [--write FILE.md]
        [--deadline S] [--nanogpt PATH]
    python benchmarks/gpu_checklist.py --data DATA_DIR --dry-run     # on CPU: every stage's commands, checked

DATA_DIR: a data dir prepared with the GPT-2 tokenizer (`pretrainer prepare --corpus stdlib --tokenizer
gpt2 --val-fraction 0.03 --out data/stdlib-gpt2`, which needs the GPT-2 ranks `make setup` caches). A
stage prints PASS or FAIL with its evidence and its figures; the exit code is the number of failures.
--deadline: a stage whose estimate no longer fits is skipped, a running one is cut off there.
--dry-run needs no GPU: it walks every stage, checks each `pretrainer` command's config and overrides
as the trainer would read them (a misspelt key costs no GPU time), and prints what the stage runs.

Stages, most valuable first (STAGES below; `--stages` picks some, default all that fit the GPUs here):
  compiled_bf16      GPT-2 124M, train.compile = auto, bf16: the SDPA kernel used (flash or cuDNN), host
                     syncs after the first interval, MFU against the hardware table, peak memory against plan
  speed_vs_nanogpt   124M tokens/s: the bare loop, pretrainer and nanoGPT (--nanogpt) in one process
  resume             20 steps straight against 10 + 10 resumed with train.deterministic: bit for bit
  quality_vs_nanogpt one time-to-quality point at 124M against nanoGPT (needs --nanogpt)
  muon_step          Muon's optimizer step against fused AdamW's at 124M: milliseconds, operators
  cuda_tests         the suite's tests marked cuda (CUDA's sync debug mode, serve-cost on CUDA)
  checkpoint         what each checkpoint of 124M cost the training thread (its logged checkpoint_s)
  budget             a capped run whose cap the steady rate affords (compile makes step 1 slow): exit 0
  nccl               a torchrun process group over every GPU here and an all-reduce
  resume_default     the resume without train.deterministic: the largest loss difference
  packing            document packing against concat: the attention kernel and tokens/s
  micro_batch        micro_batch = auto (global batch 64): the size found, its first steps, the run's peak
  lowbit             AdamW 8-bit against AdamW: tokens/s, host syncs per step, memory (needs torchao)
  serve_cost         serve-cost of a 124M run (bf16, int8, int4): decode tokens/s, $/M tokens (torchao)
  vs_nanogpt         time to quality against nanoGPT at 384x6 and 768x12, 300 and 600 steps (<= 0.75)
  llama_1b           the 1.2B Llama shape at seq 2048, activation checkpointing, against plan
Stages for several GPUs:
  ddp_fsdp           --nproc N with DDP and with FSDP against one process: the largest loss difference
  hang_drill         the last rank stops answering: the others exit 3 within parallel.timeout_s
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE_LIMIT_S = 540  # a stage's commands together: under one device call's 10 minutes
NCCL_SMOKE = (
    "import os, torch, torch.distributed as d; d.init_process_group('nccl'); "
    "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); t = torch.ones(1, device='cuda'); "
    "d.all_reduce(t); torch.cuda.synchronize(); print('nccl all_reduce ok', t.item()); "
    "d.destroy_process_group()"
)
# SDPA's fused kernels for causal training: flash, or cuDNN's (preferred on sm90 from cuDNN 9.15 on)
FAST_ATTENTION = ("flash", "cudnn")
GPT2 = ["configs/gpt2-124m.toml", "--track.backends=none", "--eval.every=0", "--ckpt.every=0"]


@dataclass
class Command:
    """One process a stage runs: `pretrainer ARGS` (checked in --dry-run) or any other argv."""

    argv: list[str]
    run_dir: str = ""  # the run dir a train command writes (its metrics are read afterwards)
    timeout_s: int = STAGE_LIMIT_S

    @property
    def is_pretrainer(self) -> bool:
        return self.argv[:1] == ["pretrainer"]


@dataclass
class Outcome:
    code: int
    out: str
    seconds: float
    records: list[dict] = field(default_factory=list)  # the run dir's metrics.jsonl


@dataclass
class Stage:
    name: str
    gpus: int  # the fewest GPUs it needs
    measures: str
    commands: Callable[[argparse.Namespace, str], list[Command]]
    judge: Callable[[list[Outcome]], tuple[bool, str, dict]]
    # seconds on one H100 or H200 from process start to verdict, compiles included: the first process
    # to compile the 124M blocks pays ~60-90 s, later ones of the same shapes find inductor's on-disk
    # cache (every 124M stage trains micro-batches of 16 x 1024 for that reason). Estimated from the
    # CPU runs and published H100 figures until a GPU measures them (then: the seconds in the JSON).
    estimate_s: int = 120
    needs: str = ""  # what must be given or installed ("nanogpt", "torchao"); else the stage is skipped


def train(run_dir: str, *overrides: str) -> Command:
    return Command(["pretrainer", "train", *GPT2[:1], f"--run.dir={run_dir}", *GPT2[1:], *overrides], run_dir)


def data(args) -> str:
    return f"--data.dir={args.data}"


def logged(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None]


def median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def losses(outcome: Outcome) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in outcome.records if "loss" in r}


def largest_difference(a: Outcome, b: Outcome) -> float | None:
    la, lb = losses(a), losses(b)
    shared = sorted(set(la) & set(lb))
    return max(abs(la[s] - lb[s]) for s in shared) if shared else None


def plan_total_gib(out: str) -> float | None:
    try:
        return json.loads(out)["memory_per_gpu_bytes"]["total"] / 2**30
    except (ValueError, KeyError):
        return None


# --- the stages ---


def nccl_commands(args, tmp):
    gpus = max(1, args.gpus)
    return [
        Command(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
            + ["--no-python", sys.executable, "-c", NCCL_SMOKE]
        )
    ]


def nccl_judge(outcomes):
    (o,) = outcomes
    ok = o.code == 0 and "nccl all_reduce ok" in o.out
    return ok, o.out.strip().splitlines()[-1] if o.out.strip() else "", {}


def cuda_tests_commands(args, tmp):
    return [Command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"])]


def cuda_tests_judge(outcomes):
    (o,) = outcomes
    last = o.out.strip().splitlines()[-1] if o.out.strip() else ""
    return o.code == 0 and "passed" in last, last, {}


def compiled_commands(args, tmp):
    run = f"{tmp}/compiled_bf16"
    return [
        train(
            run,
            data(args),
            "--train.max_steps=60",
            "--train.micro_batch=16",
            "--log.every=10",
            "--train.audit_syncs=true",
            "--train.dtype=bfloat16",
        ),
        Command(
            ["pretrainer", "plan", "configs/gpt2-124m.toml", "--gpus", "1", "--json"]
            + ["--train.micro_batch=16", "--train.grad_accum=1", data(args)]
        ),
    ]


def compiled_judge(outcomes):
    run, plan = outcomes
    attention = re.search(r"attention (\w+)", run.out)
    syncs = logged(run.records, "host_syncs_per_step")[1:]  # the first interval compiles and autotunes
    mfu, peak = (
        median(logged(run.records, "mfu")[1:]),
        max(logged(run.records, "peak_memory_gib"), default=None),
    )
    planned = plan_total_gib(plan.out)
    figures = {
        "attention": attention.group(1) if attention else None,
        "host_syncs_after_first_interval": syncs,
        "tokens_per_s": median(logged(run.records, "tokens_per_s")[1:]),
        "mfu": mfu,
        "peak_memory_gib": peak,
        "peak_reserved_gib": max(logged(run.records, "peak_reserved_gib"), default=None),
        "plan_memory_gib": planned,
        "compiled": "compiled per block" in run.out,
    }
    ok = (
        run.code == 0
        and figures["attention"] in FAST_ATTENTION
        and bool(syncs)
        and max(syncs) == 0
        and figures["compiled"]
        and mfu is not None
        and peak is not None
        and planned is not None
        and peak <= planned * 1.1
    )
    return ok, f"attention {figures['attention']}, MFU {mfu}, peak {peak} GiB vs plan {planned} GiB", figures


def micro_batch_commands(args, tmp):
    return [
        train(
            f"{tmp}/auto",
            data(args),
            "--train.micro_batch=auto",
            "--train.global_batch=64",
            "--train.max_steps=20",
            "--log.every=5",
        )
    ]


def micro_batch_judge(outcomes):
    (o,) = outcomes
    found = re.search(r"micro-batch auto: (\d+)", o.out)
    peaks = logged(o.records, "peak_memory_gib")
    figures = {"micro_batch": int(found.group(1)) if found else None, "peak_memory_gib": peaks}
    return o.code == 0 and found is not None, found.group(0) if found else o.out[-300:], figures


def resume_commands(deterministic: bool):
    """20 steps straight against 10 + 10 resumed (three compiled processes: a stage each way)."""

    def commands(args, tmp):
        flag = f"--train.deterministic={str(deterministic).lower()}"
        common = [data(args), "--train.max_steps=20", "--train.micro_batch=16", "--log.every=1", flag]
        return [
            train(f"{tmp}/straight", *common),
            train(f"{tmp}/resumed", *common, "--ckpt.every=10", "--train.stop_at_step=10"),
            train(f"{tmp}/resumed", *common),
        ]

    return commands


def resume_judge(deterministic: bool):
    def judge(outcomes):
        straight, _, resumed = outcomes
        difference = largest_difference(straight, resumed)
        ran = all(o.code == 0 for o in outcomes) and difference is not None
        ok = ran and (difference == 0.0 if deterministic else True)  # the default: measured, not judged
        return (
            ok,
            f"largest loss difference, resumed against straight: {difference}",
            {"difference": difference},
        )

    return judge


def budget_commands(args, tmp):
    # $3/GPU-hour, cap $1: 60 steady steps of 124M cost cents; compile makes step 1 take ~a minute
    return [
        train(
            f"{tmp}/budget",
            data(args),
            "--train.max_steps=60",
            "--train.micro_batch=16",
            "--budget.cap_usd=1",
            "--budget.usd_per_gpu_hour=3",
            "--log.every=10",
        )
    ]


def budget_judge(outcomes):
    (o,) = outcomes
    spent = logged(o.records, "spent_usd")
    return (
        o.code == 0,
        f"exit {o.code}, spent ${spent[-1] if spent else '?'} of a $1 cap",
        {"spent_usd": spent},
    )


def checkpoint_commands(args, tmp):
    common = [data(args), "--train.max_steps=40", "--train.micro_batch=16", "--log.every=10"]
    return [train(f"{tmp}/ckpt", *common, "--ckpt.every=10")]


def checkpoint_judge(outcomes):
    """What each checkpoint cost the training thread (the run logs it as checkpoint_s: periodic ones are
    written in the background, the last one is waited for), against the steps' own time."""
    (o,) = outcomes
    paused = logged(o.records, "checkpoint_s")
    steps_s = [r["elapsed_s"] for r in o.records if "loss" in r]
    figures = {
        "checkpoint_s": paused,
        "median_checkpoint_s": median(paused),
        "train_s": steps_s[-1] - steps_s[0] if len(steps_s) > 1 else None,
    }
    ok = o.code == 0 and len(paused) >= 3
    return ok, f"checkpoint_s per checkpoint of GPT-2 124M (weights + optimizer): {paused}", figures


def packing_commands(args, tmp):
    common = [data(args), "--train.max_steps=40", "--train.micro_batch=16", "--log.every=10"]
    return [
        train(f"{tmp}/concat", *common, "--data.packing=concat"),
        train(f"{tmp}/document", *common, "--data.packing=document"),
    ]


def packing_judge(outcomes):
    figures = {}
    for name, o in zip(("concat", "document"), outcomes):
        attention = re.search(r"attention (\w+)", o.out)
        figures[name] = {
            "attention": attention.group(1) if attention else None,
            "tokens_per_s": median(logged(o.records, "tokens_per_s")[1:]),
        }
    ok = all(o.code == 0 for o in outcomes) and figures["document"]["attention"] == "flex"
    return ok, json.dumps(figures), figures


def lowbit_commands(args, tmp):
    common = [data(args), "--train.max_steps=40", "--train.micro_batch=16", "--log.every=10"]
    return [
        train(f"{tmp}/adamw", *common, "--train.audit_syncs=true"),
        train(f"{tmp}/adamw8bit", *common, "--optim.name=adamw8bit", "--train.audit_syncs=true"),
    ]


def lowbit_judge(outcomes):
    figures = {
        name: {
            "tokens_per_s": median(logged(o.records, "tokens_per_s")[1:]),
            "host_syncs_per_step": median(logged(o.records, "host_syncs_per_step")[1:]),
            "peak_memory_gib": max(logged(o.records, "peak_memory_gib"), default=None),
        }
        for name, o in zip(("adamw", "adamw8bit"), outcomes)
    }
    return all(o.code == 0 for o in outcomes), json.dumps(figures), figures


def serve_cost_commands(args, tmp):
    run = f"{tmp}/serve"
    return [
        train(run, data(args), "--train.max_steps=20", "--train.micro_batch=16"),
        Command(["pretrainer", "serve-cost", run, "--variants", "bf16,int8,int4", "--batch-sizes", "1,32"]),
    ]


def serve_cost_judge(outcomes):
    _, o = outcomes
    return all(x.code == 0 for x in outcomes), o.out.strip()[-600:], {}


def speed_commands(args, tmp):
    """throughput.py at the micro-batch every 124M stage trains (its compiled graphs are cached)."""
    nanogpt = ["--nanogpt", args.nanogpt] if args.nanogpt else []
    return [
        Command(
            [sys.executable, "benchmarks/throughput.py", "configs/gpt2-124m.toml", "--data", args.data]
            + ["--variants", "compile", "--micro-batches", "16", "--steps", "30", "--warmup", "20"]
            + ["--repeats", "1", *nanogpt]
        )
    ]


def quality_commands(args, tmp):
    return [
        Command(
            [sys.executable, "benchmarks/vs_nanogpt.py", "--data", args.data, "--nanogpt", args.nanogpt]
            + ["--device", "cuda", "--sizes", "768x12", "--horizons", "200", "--evals", "4"]
            + ["--eval-batches", "20", "--train.compile=false"]  # nanoGPT's side is not compiled either
        )
    ]


def muon_step_commands(args, tmp):
    return [
        Command(
            [sys.executable, "benchmarks/optimizer_ops.py", "--config", "configs/gpt2-124m.toml"]
            + ["--names", "muon,adamw", "--device", "cuda", "--time", "20"]
        )
    ]


def table_judge(outcomes):
    (o,) = outcomes
    return o.code == 0, "the table below", {"table": o.out.strip()[-4000:]}


def vs_nanogpt_commands(args, tmp):
    if not args.nanogpt:
        return [Command([sys.executable, "-c", "raise SystemExit('vs_nanogpt: give --nanogpt PATH')"])]
    return [
        Command(
            [sys.executable, "benchmarks/vs_nanogpt.py", "--data", args.data, "--nanogpt", args.nanogpt]
            + ["--device", "cuda", "--sizes", "384x6,768x12", "--horizons", "300,600", "--evals", "6"]
            + ["--eval-batches", "20", "--train.compile=false"]  # nanoGPT's side is not compiled either
        )
    ]


def vs_nanogpt_judge(outcomes):
    (o,) = outcomes
    fractions = re.findall(r"\| ([\d.]+|> 1) \|$", o.out, re.MULTILINE)
    ok = o.code == 0 and bool(fractions) and all(f != "> 1" and float(f) <= 0.75 for f in fractions)
    return ok, f"fractions of nanoGPT's tokens: {', '.join(fractions)}", {"table": o.out.strip()[-3000:]}


def llama_commands(args, tmp):
    return [
        Command(
            [sys.executable, "benchmarks/throughput.py", "configs/llama3-1b.toml", "--data", args.data]
            + ["--variants", "compile+ac", "--micro-batches", "8", "--steps", "20", "--warmup", "10"]
            + ["--repeats", "1", "--model.vocab_size=131072"]
        ),
        Command(
            ["pretrainer", "plan", "configs/llama3-1b.toml", "--gpus", "1", "--gpu", "h100-sxm"]
            + ["--train.activation_checkpointing=true", "--model.vocab_size=131072"]
        ),
    ]


def llama_judge(outcomes):
    table, plan = outcomes
    ok = table.code == 0 and plan.code == 0
    return (
        ok,
        "the table and plan below",
        {"table": table.out.strip()[-3000:], "plan": plan.out.strip()[-1500:]},
    )


def ddp_fsdp_commands(args, tmp):
    common = [data(args), "--train.max_steps=20", "--train.micro_batch=8", "--log.every=1"]
    n = max(2, args.gpus)
    return [
        train(f"{tmp}/single", *common, f"--train.grad_accum={n}"),
        train(f"{tmp}/ddp", *common, "--nproc", str(n), "--parallel.strategy=ddp", "--train.grad_accum=1"),
        train(f"{tmp}/fsdp", *common, "--nproc", str(n), "--parallel.strategy=fsdp", "--train.grad_accum=1"),
    ]


def ddp_fsdp_judge(outcomes):
    single, ddp, fsdp = outcomes
    figures = {"ddp": largest_difference(single, ddp), "fsdp": largest_difference(single, fsdp)}
    ok = all(o.code == 0 for o in outcomes) and all(v is not None and v < 2e-2 for v in figures.values())
    return ok, f"largest loss difference against one process (bf16): {figures}", figures


def hang_commands(args, tmp):
    return [
        train(
            f"{tmp}/hang",
            data(args),
            "--train.max_steps=20",
            "--train.micro_batch=8",
            "--nproc",
            str(max(2, args.gpus)),
            "--parallel.hang_drill_step=5",
            "--parallel.timeout_s=60",
        )
    ]


def hang_judge(outcomes):
    (o,) = outcomes
    return o.code == 3, f"exit {o.code} after {o.seconds:.0f} s (expected 3 within ~60 s + start-up)", {}


# Most valuable first, so that any prefix of the list is worth its time: the 124M speed, memory and
# kernel against plan and against nanoGPT, then bit-exact resume, time to quality, the optimizer step,
# and the rest. estimate_s: see Stage.
STAGES = [
    Stage(
        "compiled_bf16",
        1,
        "attention kernel, host syncs, MFU, peak memory vs plan",
        compiled_commands,
        compiled_judge,
        estimate_s=130,
    ),
    Stage(
        "speed_vs_nanogpt",
        1,
        "GPT-2 124M compiled bf16 tokens/s: bare loop, pretrainer, nanoGPT (with --nanogpt), one process",
        speed_commands,
        table_judge,
        estimate_s=120,
    ),
    Stage(
        "resume",
        1,
        "a resumed run against a straight one, train.deterministic: bit for bit",
        resume_commands(True),
        resume_judge(True),
        estimate_s=100,
    ),
    Stage(
        "quality_vs_nanogpt",
        1,
        "one time-to-quality point at 124M (200 steps): the fraction of nanoGPT's tokens",
        quality_commands,
        vs_nanogpt_judge,
        estimate_s=90,
        needs="nanogpt",
    ),
    Stage(
        "muon_step",
        1,
        "Muon's optimizer step against fused AdamW's at 124M: milliseconds and operators per step",
        muon_step_commands,
        table_judge,
        estimate_s=40,
    ),
    Stage(
        "cuda_tests", 1, "the suite's tests marked cuda", cuda_tests_commands, cuda_tests_judge, estimate_s=60
    ),
    Stage("checkpoint", 1, "seconds per checkpoint of GPT-2 124M", checkpoint_commands, checkpoint_judge, 60),
    Stage(
        "budget",
        1,
        "a cap the steady rate affords: exit 0 despite a slow compiled step 1",
        budget_commands,
        budget_judge,
        estimate_s=60,
    ),
    Stage(
        "nccl",
        1,
        "a torchrun process group over every GPU here and an all-reduce",
        nccl_commands,
        nccl_judge,
        estimate_s=30,
    ),
    Stage(
        "resume_default",
        1,
        "the same without train.deterministic: how far from bit-exact",
        resume_commands(False),
        resume_judge(False),
        estimate_s=100,
    ),
    Stage(
        "packing",
        1,
        "document packing vs concat: attention kernel, tokens/s",
        packing_commands,
        packing_judge,
        estimate_s=180,
    ),
    Stage(
        "micro_batch",
        1,
        "micro_batch = auto: the size found and its first steps",
        micro_batch_commands,
        micro_batch_judge,
        estimate_s=300,  # every size it tries is a graph of its own: compiles are static
    ),
    Stage(
        "lowbit",
        1,
        "AdamW 8-bit vs AdamW: tokens/s, host syncs, memory",
        lowbit_commands,
        lowbit_judge,
        estimate_s=180,
        needs="torchao",
    ),
    Stage(
        "serve_cost",
        1,
        "decode tokens/s and $/M tokens for bf16, int8, int4",
        serve_cost_commands,
        serve_cost_judge,
        estimate_s=150,
        needs="torchao",
    ),
    Stage(
        "vs_nanogpt",
        1,
        "the default recipe's time to quality against nanoGPT at 384x6 and 124M, 300 and 600 steps",
        vs_nanogpt_commands,
        vs_nanogpt_judge,
        estimate_s=420,
        needs="nanogpt",
    ),
    Stage(
        "llama_1b",
        1,
        "the 1.2B shape's tokens/s, MFU, memory vs plan",
        llama_commands,
        llama_judge,
        estimate_s=300,
    ),
    Stage(
        "ddp_fsdp",
        2,
        "DDP and FSDP on N GPUs against one process",
        ddp_fsdp_commands,
        ddp_fsdp_judge,
        estimate_s=300,
    ),
    Stage("hang_drill", 2, "a silent rank: exit 3, not a hang", hang_commands, hang_judge, estimate_s=150),
]


# --- running them ---


def run_command(command: Command, timeout_s: float | None = None) -> Outcome:
    """The command in a process group of its own (killed whole at its timeout: throughput.py's nanoGPT,
    torchrun's ranks), from the repository's root."""
    argv = [sys.executable, "-m", "pretrainer", *command.argv[1:]] if command.is_pretrainer else command.argv
    # the caller's PYTHONPATH stays (packages brought as wheels with pip --target live there), after src
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    limit = min(command.timeout_s, timeout_s) if timeout_s is not None else command.timeout_s
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            code = child.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:  # one stuck command must not lose the others' results
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = 124
        log.seek(0)
        out = log.read()
    if code == 124:
        out += f"\ntimed out after {limit:.0f} s: {shlex.join(argv)[:300]}"
    records = []
    metrics = Path(command.run_dir) / "metrics.jsonl" if command.run_dir else None
    if metrics is not None and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return Outcome(code, out, time.monotonic() - started, records)


def check_command(command: Command) -> str:
    """--dry-run: '' when a pretrainer command's config and overrides read as the trainer reads them (the
    data dir need not exist), else the one-line error; other commands are not run."""
    if not command.is_pretrainer or command.argv[1] not in ("train", "plan"):
        return ""
    from pretrainer.config.load import load_config
    from pretrainer.core.errors import UserError

    words = [w for w in command.argv[2:] if not w.startswith("--data.dir=")]
    config = words[0] if words and not words[0].startswith("-") else None
    overrides, skip = [], {"--nproc", "--gpus", "--gpu", "--tokens"}
    rest = words[1:] if config else words
    i = 0
    while i < len(rest):
        if rest[i] in skip:
            i += 2
            continue
        if rest[i] != "--json":
            overrides.append(rest[i])
        i += 1
    try:
        load_config(ROOT / config if config else None, overrides)
    except UserError as e:
        return str(e)
    return ""


def missing(stage: Stage, args) -> str:
    """Why this machine or this call cannot run the stage ('' when it can)."""
    if stage.gpus > args.gpus:
        return f"needs {stage.gpus} GPUs, {args.gpus} here"
    if stage.needs == "nanogpt" and not args.nanogpt:
        return "needs --nanogpt (a nanoGPT checkout's train.py, model.py, configurator.py)"
    if stage.needs == "torchao" and importlib.util.find_spec("torchao") is None:
        return "needs torchao (pip install 'pretrainer[lowbit]'), not installed here"
    return ""


def dry_run(stages: list[Stage], args, say=print) -> int:
    """Every stage's commands checked as the trainer reads them, printed with what it measures and its
    estimate. -> the number of stages with a command the trainer would refuse."""
    failures = 0
    for stage in stages:
        commands = stage.commands(args, "RUNS")
        problems = [p for p in (check_command(c) for c in commands) if p]
        failures += bool(problems)
        verdict = "FAIL" if problems else "ok  "
        estimate = f"~{stage.estimate_s} s"
        say(f"{verdict}  {stage.name} (>= {stage.gpus} GPU, {estimate}): would measure {stage.measures}")
        for command in commands:
            say(f"        {shlex.join(command.argv)}")
        for problem in problems:
            say(f"        error: {problem}")
    return failures


def run_stages(stages: list[Stage], args, results: dict, out: Path, deadline: float | None, say=print) -> int:
    """Each stage in order, its verdict and figures merged into `results` and written to `out` (whole or
    not at all: a killed call keeps the stages before it). With a deadline (time.monotonic()), a stage
    whose estimate no longer fits is skipped and a running one is cut off there. -> failures."""
    failures = 0
    for stage in stages:
        left = None if deadline is None else deadline - time.monotonic()
        reason = missing(stage, args) or (
            f"~{stage.estimate_s} s needed, {left:.0f} s left"
            if left is not None and stage.estimate_s > left
            else ""
        )
        if reason:
            say(f"skip  {stage.name}: {reason}")
            results["stages"][stage.name] = {
                "ok": None,
                "evidence": f"skipped: {reason}",
                "figures": {},
                "seconds": 0.0,
                "commands": [],
                "date": today(),
            }
            continue
        outcomes = []
        with tempfile.TemporaryDirectory() as tmp:
            commands = stage.commands(args, tmp)
            for command in commands:
                left = None if deadline is None else deadline - time.monotonic()
                outcomes.append(run_command(command, left))
                if outcomes[-1].code == 124:
                    break
            try:
                ok, evidence, figures = (
                    stage.judge(outcomes)
                    if len(outcomes) == len(commands)
                    else (False, "cut off at the deadline", {})
                )
            except Exception as e:  # noqa: BLE001 (a judge reading a broken run's output: a FAIL, not a crash)
                ok, evidence, figures = False, f"judge failed: {type(e).__name__}: {e}", {}
        failures += not ok
        say(f"{'PASS' if ok else 'FAIL'}  {stage.name}: {evidence}")
        if not ok:
            say("\n".join(o.out.strip()[-1500:] for o in outcomes if o.code != 0))
        results["stages"][stage.name] = {
            "ok": ok,
            "evidence": evidence,
            "figures": figures,
            "seconds": round(sum(o.seconds for o in outcomes), 1),
            "estimate_s": stage.estimate_s,
            "commands": [shlex.join(c.argv) for c in commands],
            "date": today(),
            "output_tail": "\n".join(o.out.strip()[-1500:] for o in outcomes),
        }
        tmp_out = Path(f"{out}.tmp")
        tmp_out.write_text(json.dumps(results, indent=2) + "\n")
        tmp_out.replace(out)
    return failures


def today() -> str:
    return datetime.date.today().isoformat()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="a data dir prepared with --tokenizer gpt2")
    parser.add_argument("--stages", default="", help="comma-separated stage names (default: all that fit)")
    parser.add_argument("--nanogpt", default="", help="a nanoGPT checkout, to compare on the same GPU")
    parser.add_argument("--out", default="gpu_checklist.json", help="the results JSON (merged by stage)")
    parser.add_argument("--write", default="", help="append the results table to this markdown file")
    parser.add_argument("--deadline", type=float, default=0, help="seconds for all stages (0: no limit)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: walk the stages, check, print")
    args = parser.parse_args()
    import torch

    names = [s.name for s in STAGES]
    chosen = [n.strip() for n in args.stages.split(",") if n.strip()] or names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"error: unknown stage(s) {', '.join(unknown)}; the stages: {', '.join(names)}")
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_checklist: no CUDA device; this script is for a machine with a GPU (--dry-run: on CPU)")
        return 2
    args.gpus = torch.cuda.device_count() if not args.dry_run else 8
    stages = [s for s in STAGES if s.name in chosen]
    if args.dry_run:
        failures = dry_run(stages, args)
        print(f"dry run: {len(stages)} stages, {failures} with a command the trainer would refuse")
        return failures
    results = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {"stages": {}}
    results.update(gpu=torch.cuda.get_device_name(0), gpus=args.gpus, torch=torch.__version__)
    deadline = time.monotonic() + args.deadline if args.deadline else None
    failures = run_stages(stages, args, results, Path(args.out), deadline)
    if args.write:
        write_markdown(results, args)
    return failures


def results_markdown(results: dict, command: str) -> str:
    """The results as one table (stage, result, evidence, seconds against the estimate), then the tables
    and plans some stages print."""
    verdict = {True: "PASS", False: "FAIL", None: "skipped"}
    lines = [
        f"## GPU checklist: {results.get('gpu', '?')} x {results.get('gpus', '?')}, "
        f"torch {results.get('torch', '?')}",
        "",
        f"Command: `{command}`",
        "",
        "| stage | date | result | evidence | seconds (estimate) |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for name, r in results["stages"].items():
        evidence = r["evidence"].replace("|", "/").replace("\n", " ")[:300]
        estimate = f" ({r['estimate_s']})" if r.get("estimate_s") else ""
        lines.append(f"| {name} | {r['date']} | {verdict[r['ok']]} | {evidence} | {r['seconds']}{estimate} |")
    for name, r in results["stages"].items():
        for key in ("table", "plan"):
            if key in r["figures"]:
                lines += ["", f"{name} ({key}):", "", "```", r["figures"][key], "```"]
    return "\n".join(lines) + "\n"


def write_markdown(results: dict, args) -> None:
    command = (
        f"python benchmarks/gpu_checklist.py --data {args.data} --stages STAGE` per stage "
        f"(results in `{args.out}`"
    )
    with open(args.write, "a") as f:
        f.write("\n" + results_markdown(results, command))


if __name__ == "__main__":
    sys.exit(main())
