"""The project's first contact with a GPU in one call: from a bare, offline node to the figures that
matter, within a deadline, every result written to OUT_DIR as it comes (nothing else survives the node).

    benchmarks/gpu_first_call.sh OUT_DIR [--deadline 530] [--dry-run]   # installs offline, then this
    python benchmarks/gpu_first_call.py --pack --nanogpt PATH           # here, with PyPI: the cache dir

The cache dir (--cache, default .cache/first-call, git-ignored; the device tool's `carry` takes it) holds
what a node without network lacks: `wheels/` (scripts/wheelhouse.py for the node's Python and packages,
benchmarks/site_packages_cuda.txt), `gpt2.tiktoken` (the GPT-2 ranks `make setup` verified) and
`nanogpt/` (nanoGPT's train.py, model.py and configurator.py, for the side-by-side stages). --pack
makes it (a few MiB).

Phases, most valuable first; each is skipped when its estimate no longer fits before the deadline, and
a running one is cut off there (estimates: seconds on one H100/H200 from a bare node, compiles included;
the checklist's Stage.estimate_s says how they were reckoned):
  env (15 s)     versions (Python, torch, CUDA, cuDNN, triton, driver), the GPU, the SDPA kernel the
                 124M model's attention runs in bf16, a bf16 matmul's TFLOP/s (the GPU's own peak, for
                 MFU beside the table's), the node's `pip list` (pip-freeze.txt)
  data (30 s)    `pretrainer prepare --corpus stdlib --tokenizer gpt2` with a validation split large
                 enough that every evaluation batch of 16 x 1024 is full
  then benchmarks/gpu_checklist.py's stages in its order: compiled_bf16, speed_vs_nanogpt, resume,
                 quality_vs_nanogpt, muon_step, cuda_tests, checkpoint, budget, ... (as time allows)

OUT_DIR gets first-call.md (the one table, printed at the end too), first-call.json (every figure and
each command's output tail), pip-freeze.txt and log.txt (everything printed). --dry-run (CPU): the env
and data phases run for real on a small corpus, every stage's commands are checked as the trainer reads
them, and the plan of phases against the deadline is printed and judged; the suite runs it in a
simulated site image (tests/integration/test_offline_install.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_checklist  # noqa: E402 (the stages, their commands, judges and runner)

DEADLINE_S = 530  # a 10-minute device call, less the start, the install and the copy back
ENV_ESTIMATE_S, DATA_ESTIMATE_S = 15, 30
EVAL_BATCHES, MICRO_BATCH, SEQ_LEN = 20, 16, 1024  # the checklist's evaluations: every batch full
VAL_FRACTION = 0.03  # of the stdlib's ~15M GPT-2 tokens: ~450K, over the 20 x 16 x 1024 evaluations need
# the stages a first call is for: a plan of phases that does not reach them all is a failed dry run
FIRST = ["compiled_bf16", "speed_vs_nanogpt", "resume", "quality_vs_nanogpt", "muon_step"]


class Call:
    """The call's clock, its output folder and what it has found so far (written after every phase)."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = args.started_at + args.deadline
        self.log = open(self.out / "log.txt", "a")
        self.results = {"deadline_s": args.deadline, "dry_run": args.dry_run, "phases": {}, "stages": {}}

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def save(self) -> None:
        for name, text in (("first-call.json", json.dumps(self.results, indent=2) + "\n"),):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / name)


def run(call: Call, argv: list[str], timeout_s: float) -> tuple[int, str]:
    """A command through the checklist's runner (its own process group, the caller's PYTHONPATH kept),
    its output logged."""
    outcome = gpu_checklist.run_command(gpu_checklist.Command(argv, timeout_s=int(max(1, timeout_s))))
    call.say(outcome.out.strip()[-4000:])
    return outcome.code, outcome.out


def env_phase(call: Call) -> dict:
    started = time.time()
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout
    (call.out / "pip-freeze.txt").write_text(freeze)
    code, out = run(call, [sys.executable, "benchmarks/gpu_env.py"], min(120, call.left()))
    line = next((line for line in out.splitlines() if line.startswith("ENV ")), None)
    report = json.loads(line[4:]) if line else {"error": out.strip()[-500:]}
    call.results.update(gpu=report.get("gpu"), gpus=report.get("gpus", 0), torch=report.get("torch"))
    call.results["phases"]["env"] = {
        "ok": code == 0 and line is not None,
        "figures": report,
        "seconds": round(time.time() - started, 1),
    }
    return report


def data_phase(call: Call, work: Path) -> Path:
    """The stdlib with GPT-2's BPE into work/data; the ranks come from the cache dir (no network)."""
    started, data = time.time(), work / "data"
    ranks = Path(call.args.cache) / "gpt2.tiktoken"
    if ranks.is_file():  # carried: the children read them from a cache of the call's own
        env_cache = work / "pretrainer-cache"
        env_cache.mkdir(parents=True, exist_ok=True)
        shutil.copy(ranks, env_cache / "gpt2.tiktoken")
        os.environ["PRETRAINER_CACHE"] = str(env_cache)
    command = ["pretrainer", "prepare", "--corpus", "stdlib", "--tokenizer", "gpt2", "--val-fraction"]
    command += [str(VAL_FRACTION), "--out", str(data), "--force"]
    if call.args.dry_run:
        command += ["--max-docs", "100"]  # the same path, a CPU's second or two
    code, _ = run(call, command, call.left())
    figures = {}
    if code == 0:
        splits = json.loads((data / "manifest.json").read_text())["splits"]
        figures = {f"{name}_tokens": splits[name]["tokens"] for name in ("train", "val")}
        windows = figures["val_tokens"] // SEQ_LEN
        figures["val_windows"] = windows
        figures["full_eval_batches"] = windows >= EVAL_BATCHES * MICRO_BATCH
    ok = code == 0 and (figures.get("full_eval_batches") or call.args.dry_run)
    call.results["phases"]["data"] = {
        "ok": bool(ok),
        "figures": figures,
        "seconds": round(time.time() - started, 1),
    }
    return data


def plan_phases(call: Call, stages: list) -> list[tuple[str, int, str]]:
    """Dry run: each stage planned or skipped by the estimates alone, from a bare node's start."""
    clock, plan = ENV_ESTIMATE_S + DATA_ESTIMATE_S, []
    for stage in stages:
        reason = gpu_checklist.missing(stage, call.args)
        if not reason and clock + stage.estimate_s > call.args.deadline:
            reason = f"~{stage.estimate_s} s needed, {call.args.deadline - clock} s left"
        if not reason:
            clock += stage.estimate_s
        plan.append((stage.name, clock, reason))
    return plan


def peak_against_measured(results: dict, env: dict) -> None:
    """MFU against the GPU's own peak beside the table's: the compiled run's MFU rescaled by the table's
    peak over the bf16 matmul env measured."""
    figures = results["stages"].get("compiled_bf16", {}).get("figures", {})
    mfu, table, measured = figures.get("mfu"), env.get("table_peak_tflops"), env.get("matmul_tflops")
    if mfu and table and measured:
        figures["mfu_of_measured_matmul"] = round(mfu * table / measured, 4)


def summary(call: Call) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "skipped"}
    rows = ["| phase | result | figures | seconds (estimate) |", "| --- | --- | --- | ---: |"]
    for name, r in call.results["phases"].items():
        figures = ", ".join(f"{k} {v}" for k, v in r["figures"].items() if not isinstance(v, (dict, list)))
        estimate = {"env": ENV_ESTIMATE_S, "data": DATA_ESTIMATE_S}[name]
        rows.append(f"| {name} | {verdict[r['ok']]} | {figures[:400]} | {r['seconds']} ({estimate}) |")
    for name, r in call.results["stages"].items():
        figures = ", ".join(
            f"{k} {v}"
            for k, v in r["figures"].items()
            if isinstance(v, (int, float, str, bool)) and k != "table"
        )
        text = (r["evidence"] + ("; " + figures if figures else "")).replace("|", "/").replace("\n", " ")
        estimate = f" ({r['estimate_s']})" if r.get("estimate_s") else ""
        result = r.get("result") or verdict[r["ok"]]
        rows.append(f"| {name} | {result} | {text[:400]} | {r['seconds']}{estimate} |")
    env = call.results["phases"].get("env", {}).get("figures", {})
    head = [
        f"## First GPU call: {env.get('gpu') or 'no GPU (dry run)'}, torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}",
        "",
        f"Command: `benchmarks/gpu_first_call.sh OUT_DIR --deadline {call.args.deadline:.0f}"
        f"{' --dry-run' if call.args.dry_run else ''}`",
        "",
    ]
    tables = []
    for name, r in call.results["stages"].items():
        if "table" in r["figures"]:
            tables += ["", f"{name}:", "", "```", r["figures"]["table"], "```"]
    return "\n".join(head + rows + tables) + "\n"


def first_call(args) -> int:
    call = Call(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    nanogpt = Path(args.cache) / "nanogpt"
    args.nanogpt = str(nanogpt) if (nanogpt / "train.py").is_file() else ""
    failures = 0
    try:
        report = env_phase(call)
        call.save()
        args.gpus = report.get("gpus") or 0
        if not args.dry_run and not args.gpus:
            call.say("error: no CUDA device here (give --dry-run for the CPU walk-through)")
            return 2
        args.data = str(data_phase(call, work))
        call.save()
        failures += not (call.results["phases"]["env"]["ok"] and call.results["phases"]["data"]["ok"])
        stages = [s for s in gpu_checklist.STAGES if s.gpus <= max(1, args.gpus)]
        if args.dry_run:
            args.gpus = 1  # the plan for one GPU, the node this call is for
            refused = gpu_checklist.dry_run(stages, args, call.say)
            plan = plan_phases(call, stages)
            for name, clock, reason in plan:
                stage = next(s for s in stages if s.name == name)
                call.results["stages"][name] = {
                    "ok": None,
                    "result": "skipped" if reason else "planned",
                    "evidence": f"skipped: {reason}" if reason else f"planned, done by ~{clock} s",
                    "figures": {},
                    "seconds": 0.0,
                    "estimate_s": stage.estimate_s,
                    "commands": [" ".join(c.argv) for c in stage.commands(args, "RUNS")],
                    "date": gpu_checklist.today(),
                }
            planned = [name for name, _, reason in plan if not reason]
            unplanned = [name for name in FIRST if name not in planned]
            total = max((clock for _, clock, reason in plan if not reason), default=0)
            call.say(f"plan: {', '.join(planned)}: ~{total} s of {args.deadline:.0f} s")
            if unplanned:
                call.say(f"error: the plan does not reach {', '.join(unplanned)}")
            failures += refused + len(unplanned)
        else:
            failures += gpu_checklist.run_stages(
                stages,
                args,
                call.results,
                call.out / "first-call.json",
                call.deadline - time.time() + time.monotonic(),
                call.say,
            )
            peak_against_measured(call.results, report)
    finally:
        call.save()
        table = summary(call)
        (call.out / "first-call.md").write_text(table)
        call.say("\n" + table)
        call.log.close()
    return failures


def pack(args) -> int:
    """The cache dir a node without network needs: wheels, the GPT-2 ranks, nanoGPT's three files."""
    cache = Path(args.cache)
    (cache / "nanogpt").mkdir(parents=True, exist_ok=True)
    code = subprocess.call(
        [
            sys.executable,
            str(ROOT / "scripts" / "wheelhouse.py"),
            "--out",
            str(cache / "wheels"),
            "--have",
            str(ROOT / "benchmarks" / "site_packages_cuda.txt"),
            "--python-version",
            "3.12",
        ]
    )
    if code:
        return code
    from pretrainer.data.tokenizers.bpe import gpt2_ranks_path

    if not gpt2_ranks_path().is_file():
        print("error: no GPT-2 ranks here: run `make setup` (pretrainer fetch-gpt2) first", file=sys.stderr)
        return 2
    shutil.copy(gpt2_ranks_path(), cache / "gpt2.tiktoken")
    if args.nanogpt:
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(Path(args.nanogpt) / name, cache / "nanogpt" / name)
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    print(f"{cache}: {size / 2**20:.1f} MiB (the device tool carries 64 MiB of tree in all)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", help="where every result is written (the call's $OUT)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole call")
    parser.add_argument("--started-at", type=float, default=time.time(), help="the call's start (epoch s)")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "first-call"), help="what was carried")
    parser.add_argument("--work", default="/tmp/pretrainer-first-call", help="data and runs (not kept)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: walk every phase, plan, check")
    parser.add_argument("--pack", action="store_true", help="here, with PyPI: fill the cache dir")
    parser.add_argument("--nanogpt", default="", help="with --pack: a nanoGPT checkout to take 3 files from")
    args = parser.parse_args()
    if args.pack:
        return pack(args)
    if not args.out_dir:
        parser.error("give OUT_DIR")
    if importlib.util.find_spec("pretrainer") is None:
        print("error: pretrainer is not importable: run benchmarks/gpu_first_call.sh (it installs first)")
        return 2
    return first_call(args)


if __name__ == "__main__":
    sys.exit(main())
