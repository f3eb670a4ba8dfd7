"""The GPU checks in one command, for whoever gets a GPU; the figures go into
docs/benchmarks.md with the GPU, the torch version and the date.

    python benchmarks/gpu_checklist.py --data DATA_DIR [--nanogpt PATH] [--write docs/benchmarks.md]

DATA_DIR: a data dir prepared with the GPT-2 tokenizer (uint16 tokens; e.g. `pretrainer prepare
--corpus stdlib --tokenizer gpt2 --out data/stdlib-gpt2`, which needs the GPT-2 ranks cached by
`make setup`). Each check prints PASS or FAIL with its evidence; the exit code is the number of
failures. In order:
  1. NCCL: a 1-GPU torchrun process group and an all-reduce.
  2. The CUDA tests of the suite (no host sync outside logging steps under CUDA's sync debug mode).
  3. bf16 + compile + flash: a GPT-2 124M run, compiled per block; the SDPA kernel it really used
     must be flash, and no step may sync (train.audit_syncs).
  4. micro_batch = auto for GPT-2 124M at seq 1024 (global batch 64).
  5. GPT-2 124M at seq 1024: tokens/s, MFU and peak memory over micro-batches 8, 16, 32, compiled,
     against the bare loop (target: within 3%) and nanoGPT when --nanogpt is given (target: faster);
     the MFU target is >= 55% on one H100.
  6. The 1.2B Llama shape (configs/llama3-1b.toml) at seq 2048, micro-batch 8, activation
     checkpointing: tokens/s, MFU, and peak memory against `pretrainer plan` for one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NCCL_SMOKE = (
    "import torch, torch.distributed as d; d.init_process_group('nccl'); t = torch.ones(1, device='cuda'); "
    "d.all_reduce(t); torch.cuda.synchronize(); print('nccl all_reduce ok', t.item()); "
    "d.destroy_process_group()"
)


def run(cmd: list[str], timeout: int = 1800) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # one stuck check must not lose the others' results
        return 124, f"timed out after {timeout} s: {' '.join(cmd)[:200]}\n{(e.stdout or b'')[-2000:]!r}"
    return result.returncode, result.stdout + result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="a data dir prepared with --tokenizer gpt2")
    parser.add_argument("--nanogpt", default="", help="a nanoGPT checkout, to compare on the same GPU")
    parser.add_argument(
        "--write", default="", help="append the results to this markdown file (docs/benchmarks.md)"
    )
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_checklist: no CUDA device; this script is for a machine with a GPU")
        return 2
    python, results = sys.executable, []

    def check(name: str, ok: bool, evidence: str) -> None:
        results.append((name, ok, evidence))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {evidence}", flush=True)

    code, out = run(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "--no-python",
            python,
            "-c",
            NCCL_SMOKE,
        ]
    )
    check(
        "NCCL 1-GPU torchrun",
        code == 0 and "nccl all_reduce ok 1.0" in out,
        out.strip().splitlines()[-1] if out.strip() else "",
    )

    code, out = run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_ready.py", "-k", "cuda"]
    )
    check("no host sync (CUDA sync debug mode)", code == 0 and "passed" in out, out.strip().splitlines()[-1])

    gpt2 = [
        "configs/gpt2-124m.toml",
        f"--data.dir={args.data}",
        "--mlflow.enabled=false",
        "--eval.every=0",
        "--ckpt.every=0",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        code, out = run(
            [
                python,
                "-m",
                "pretrainer",
                "train",
                *gpt2,
                f"--run.dir={tmp}/bf16",
                "--train.compile=true",
                "--train.dtype=bfloat16",
                "--train.max_steps=30",
                "--train.micro_batch=16",
                "--log.every=10",
                "--train.audit_syncs=true",
            ]
        )
        attention = re.search(r"attention (\w+)", out)
        records = (
            [json.loads(line) for line in Path(f"{tmp}/bf16/metrics.jsonl").read_text().splitlines()]
            if code == 0
            else []
        )
        # the first interval compiles and autotunes (which synchronise): judge the intervals after it
        syncs = [r["host_syncs_per_step"] for r in records if "host_syncs_per_step" in r][1:]
        check(
            "bf16 + compile + flash attention",
            code == 0
            and attention is not None
            and attention.group(1) == "flash"
            and syncs
            and max(syncs) == 0,
            f"attention {attention.group(1) if attention else '?'}, host syncs "
            f"after the first interval {syncs}",
        )
        code, out = run(
            [
                python,
                "-m",
                "pretrainer",
                "train",
                *gpt2,
                f"--run.dir={tmp}/auto",
                "--train.micro_batch=auto",
                "--train.global_batch=64",
                "--train.max_steps=3",
                "--train.dtype=bfloat16",
            ]
        )
        found = re.search(r"micro-batch auto: (\d+)", out)
        check("micro_batch = auto", code == 0 and found is not None, found.group(0) if found else out[-500:])

    throughput = [python, "benchmarks/throughput.py"]
    nanogpt = ["--nanogpt", args.nanogpt] if args.nanogpt else []
    code, out_124m = run(
        [
            *throughput,
            "configs/gpt2-124m.toml",
            "--data",
            args.data,
            "--variants",
            "compile",
            "--micro-batches",
            "8,16,32",
            "--steps",
            "50",
            "--warmup",
            "20",
            "--repeats",
            "2",
            *nanogpt,
        ]
    )
    check("GPT-2 124M throughput table", code == 0, "see the table below")
    code, out_1b = run(
        [
            *throughput,
            "configs/llama3-1b.toml",
            "--data",
            args.data,
            "--variants",
            "compile+ac",
            "--micro-batches",
            "8",
            "--steps",
            "20",
            "--warmup",
            "10",
            "--repeats",
            "1",
            "--model.vocab_size=131072",
        ]
    )
    code_plan, plan = run(
        [
            python,
            "-m",
            "pretrainer",
            "plan",
            "configs/llama3-1b.toml",
            "--gpus",
            "1",
            "--gpu",
            "h100-sxm",
            "--train.activation_checkpointing=true",
        ]
    )
    check("1.2B Llama, seq 2048, activation checkpointing", code == 0, "see the table and the plan below")

    gpu, when = torch.cuda.get_device_name(0), datetime.date.today().isoformat()
    report = [
        f"## GPU checklist: {gpu}, torch {torch.__version__}, {when}",
        "",
        f"Command: `python benchmarks/gpu_checklist.py --data "
        f"{args.data}{' --nanogpt PATH' if args.nanogpt else ''}`",
        "",
        "| check | result | evidence |",
        "| --- | --- | --- |",
        *[
            f"| {name} | {'PASS' if ok else 'FAIL'} | {evidence.replace('|', '/')} |"
            for name, ok, evidence in results
        ],
        "",
        "GPT-2 124M, seq 1024:",
        "",
        "```",
        out_124m.strip()[-4000:],
        "```",
        "",
        "Llama 1.2B, seq 2048, micro-batch 8, activation checkpointing:",
        "",
        "```",
        out_1b.strip()[-3000:],
        "```",
        "",
        "`pretrainer plan` for the same run on one GPU:",
        "",
        "```",
        plan.strip()[-1500:],
        "```",
        "",
    ]
    print("\n".join(report))
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n" + "\n".join(report))
    return sum(not ok for _, ok, _ in results)


if __name__ == "__main__":
    sys.exit(main())
