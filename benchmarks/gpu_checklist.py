"""The GPU checks, in stages that each fit one lent machine's call (< 10 minutes), for whoever gets a
GPU. Every stage's result goes into one JSON (merged by stage, so stages can run in separate calls);
--write appends its table to docs/benchmarks.md with the GPU, the torch version and the date.

    python benchmarks/gpu_checklist.py --data DATA_DIR [--stages a,b] [--out FILE.json] [--write FILE.md]
    python benchmarks/gpu_checklist.py --data DATA_DIR --dry-run     # on CPU: every stage's commands, checked

DATA_DIR: a data dir prepared with the GPT-2 tokenizer (`pretrainer prepare --corpus stdlib --tokenizer
gpt2 --out data/stdlib-gpt2`, which needs the GPT-2 ranks `make setup` caches). A stage prints PASS or
FAIL with its evidence and its figures; the exit code is the number of failures. --dry-run needs no GPU:
it walks every stage, checks each `pretrainer` command's config and overrides as the trainer would read
them (a misspelt key costs no GPU time), and prints what the stage runs and measures.

Stages for one GPU (STAGES below; `--stages` picks some, default all that fit the GPUs here):
  nccl            a torchrun process group over every GPU here and an all-reduce
  cuda_tests      the suite's tests marked cuda (CUDA's sync debug mode, serve-cost on CUDA)
  compiled_bf16   GPT-2 124M, train.compile = auto, bf16: the SDPA kernel used, host syncs after the first
                  interval, MFU against the hardware table, peak memory (allocated, reserved) against plan
  micro_batch     micro_batch = auto (global batch 64): the size found, its first steps, the run's peak
  resume          20 steps straight against 10 + 10 resumed with train.deterministic: bit for bit
  resume_default  the same without it: the largest loss difference
  budget          a capped run whose cap the steady rate affords (compile makes step 1 slow): exit 0
  checkpoint      seconds per checkpoint of GPT-2 124M and what share of the run they take
  packing         document packing against concat: the attention kernel and tokens/s
  lowbit          AdamW 8-bit against AdamW: tokens/s, host syncs per step, optimizer memory
  serve_cost      serve-cost of the compiled_bf16 run (bf16, int8, int4): decode tokens/s, $/M tokens
  throughput_124m GPT-2 124M at micro-batches 16, 32 against the bare loop (and nanoGPT with --nanogpt)
  vs_nanogpt      time to quality with the default recipe against nanoGPT (needs --nanogpt), GPT-2 shapes
                  384x6 and 768x12 (124M) at 300 and 600 steps: the fraction of nanoGPT's tokens (<= 0.75)
  llama_1b        the 1.2B Llama shape at seq 2048, activation checkpointing, against plan
Stages for several GPUs:
  ddp_fsdp        --nproc N with DDP and with FSDP against one process: the largest loss difference
  hang_drill      the last rank stops answering: the others exit 3 within parallel.timeout_s
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
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
        and figures["attention"] == "flash"
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
        common = [data(args), "--train.max_steps=20", "--train.micro_batch=8", "--log.every=1", flag]
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
    return [train(f"{tmp}/no-ckpt", *common), train(f"{tmp}/ckpt", *common, "--ckpt.every=10")]


def checkpoint_judge(outcomes):
    without, with_ = outcomes
    seconds = [max(logged(o.records, "elapsed_s"), default=0.0) for o in outcomes]
    # the last logged step (40) comes before its checkpoint: the runs differ by those at 10, 20 and 30
    per_checkpoint = (seconds[1] - seconds[0]) / 3
    figures = {"run_s_without": seconds[0], "run_s_with_4": seconds[1], "s_per_checkpoint": per_checkpoint}
    ok = without.code == 0 and with_.code == 0
    return ok, f"{per_checkpoint:.1f} s per checkpoint of GPT-2 124M (weights + AdamW)", figures


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


def throughput_commands(args, tmp):
    nanogpt = ["--nanogpt", args.nanogpt] if args.nanogpt else []
    return [
        Command(
            [sys.executable, "benchmarks/throughput.py", "configs/gpt2-124m.toml", "--data", args.data]
            + ["--variants", "compile", "--micro-batches", "16,32", "--steps", "50", "--warmup", "20"]
            + ["--repeats", "1", *nanogpt]
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


STAGES = [
    Stage(
        "nccl", 1, "a torchrun process group over every GPU here and an all-reduce", nccl_commands, nccl_judge
    ),
    Stage("cuda_tests", 1, "the suite's tests marked cuda", cuda_tests_commands, cuda_tests_judge),
    Stage(
        "compiled_bf16",
        1,
        "attention kernel, host syncs, MFU, peak memory vs plan",
        compiled_commands,
        compiled_judge,
    ),
    Stage(
        "micro_batch",
        1,
        "micro_batch = auto: the size found and its first steps",
        micro_batch_commands,
        micro_batch_judge,
    ),
    Stage(
        "resume",
        1,
        "a resumed run against a straight one, train.deterministic: bit for bit",
        resume_commands(True),
        resume_judge(True),
    ),
    Stage(
        "resume_default",
        1,
        "the same without train.deterministic: how far from bit-exact",
        resume_commands(False),
        resume_judge(False),
    ),
    Stage(
        "budget",
        1,
        "a cap the steady rate affords: exit 0 despite a slow compiled step 1",
        budget_commands,
        budget_judge,
    ),
    Stage("checkpoint", 1, "seconds per checkpoint of GPT-2 124M", checkpoint_commands, checkpoint_judge),
    Stage(
        "packing",
        1,
        "document packing vs concat: attention kernel, tokens/s",
        packing_commands,
        packing_judge,
    ),
    Stage("lowbit", 1, "AdamW 8-bit vs AdamW: tokens/s, host syncs, memory", lowbit_commands, lowbit_judge),
    Stage(
        "serve_cost",
        1,
        "decode tokens/s and $/M tokens for bf16, int8, int4",
        serve_cost_commands,
        serve_cost_judge,
    ),
    Stage(
        "throughput_124m",
        1,
        "GPT-2 124M tokens/s, MFU vs the bare loop (and nanoGPT)",
        throughput_commands,
        table_judge,
    ),
    Stage(
        "vs_nanogpt",
        1,
        "the default recipe's time to quality against nanoGPT at 124M",
        vs_nanogpt_commands,
        vs_nanogpt_judge,
    ),
    Stage("llama_1b", 1, "the 1.2B shape's tokens/s, MFU, memory vs plan", llama_commands, llama_judge),
    Stage("ddp_fsdp", 2, "DDP and FSDP on N GPUs against one process", ddp_fsdp_commands, ddp_fsdp_judge),
    Stage("hang_drill", 2, "a silent rank: exit 3, not a hang", hang_commands, hang_judge),
]


# --- running them ---


def run_command(command: Command) -> Outcome:
    argv = [sys.executable, "-m", "pretrainer", *command.argv[1:]] if command.is_pretrainer else command.argv
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=command.timeout_s, env=env, cwd=ROOT
        )
        code, out = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:  # one stuck command must not lose the others' results
        code, out = (
            124,
            f"timed out after {command.timeout_s} s: {shlex.join(argv)[:200]}\n{e.stdout!r}"[-3000:],
        )
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="a data dir prepared with --tokenizer gpt2")
    parser.add_argument("--stages", default="", help="comma-separated stage names (default: all that fit)")
    parser.add_argument("--nanogpt", default="", help="a nanoGPT checkout, to compare on the same GPU")
    parser.add_argument("--out", default="gpu_checklist.json", help="the results JSON (merged by stage)")
    parser.add_argument("--write", default="", help="append the results table to this markdown file")
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
    failures = 0
    if args.dry_run:
        for stage in stages:
            commands = stage.commands(args, "RUNS")
            problems = [p for p in (check_command(c) for c in commands) if p]
            failures += bool(problems)
            verdict = "FAIL" if problems else "ok  "
            print(f"{verdict}  {stage.name} (>= {stage.gpus} GPU): would measure {stage.measures}")
            for command in commands:
                print(f"        {shlex.join(command.argv)}")
            for problem in problems:
                print(f"        error: {problem}")
        print(f"dry run: {len(stages)} stages, {failures} with a command the trainer would refuse")
        return failures
    results = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {"stages": {}}
    results.update(gpu=torch.cuda.get_device_name(0), gpus=args.gpus, torch=torch.__version__)
    for stage in stages:
        if stage.gpus > args.gpus:
            print(f"skip  {stage.name}: needs {stage.gpus} GPUs, {args.gpus} here")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            commands = stage.commands(args, tmp)
            outcomes = [run_command(c) for c in commands]
            ok, evidence, figures = stage.judge(outcomes)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {stage.name}: {evidence}", flush=True)
        if not ok:
            print("\n".join(o.out.strip()[-1500:] for o in outcomes if o.code != 0))
        results["stages"][stage.name] = {
            "ok": ok,
            "evidence": evidence,
            "figures": figures,
            "seconds": round(sum(o.seconds for o in outcomes), 1),
            "commands": [shlex.join(c.argv) for c in commands],
            "date": datetime.date.today().isoformat(),
        }
        tmp_out = Path(f"{args.out}.tmp")
        tmp_out.write_text(json.dumps(results, indent=2) + "\n")
        tmp_out.replace(args.out)  # whole or not at all: a killed call keeps the stages before it
    if args.write:
        write_markdown(results, args)
    return failures


def write_markdown(results: dict, args) -> None:
    lines = [
        f"## GPU checklist: {results['gpu']} x {results['gpus']}, torch {results['torch']}",
        "",
        f"Command: `python benchmarks/gpu_checklist.py --data {args.data} --stages STAGE` per stage "
        f"(results in `{args.out}`)",
        "",
        "| stage | date | result | evidence | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for name, r in results["stages"].items():
        evidence = r["evidence"].replace("|", "/").replace("\n", " ")[:300]
        lines.append(
            f"| {name} | {r['date']} | {'PASS' if r['ok'] else 'FAIL'} | {evidence} | {r['seconds']} |"
        )
    for name, r in results["stages"].items():
        for key in ("table", "plan"):
            if key in r["figures"]:
                lines += ["", f"{name} ({key}):", "", "```", r["figures"][key], "```"]
    with open(args.write, "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
