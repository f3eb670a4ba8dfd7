"""The command line's grammar: every verb's arguments and help (`pretrainer VERB --help`), and the
joining of `--section.key VALUE` into `--section.key=VALUE`. What each verb does is in cli/verbs_*.py."""

from __future__ import annotations

import argparse

from pretrainer import __version__
from pretrainer.cli.checked_args import OneLineParser, checked_numbers


def build_parser() -> argparse.ArgumentParser:
    return checked_numbers(verb_parser())


def verb_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pretrainer", description="Pretrain decoder-only language models from scratch."
    )
    parser.add_argument("--version", action="version", version=f"pretrainer {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=OneLineParser)

    p = verbs.add_parser("prepare", help="corpus -> tokenizer -> token files + manifest")
    p.add_argument(
        "--corpus",
        action="append",
        help="stdlib | PATH (.txt/.jsonl/.parquet file, dir or glob; .gz/.zst/.bz2/.xz too) | "
        "hf:ORG/NAME[:GLOB]; repeatable",
    )
    p.add_argument(
        "--from-hub",
        metavar="ORG/NAME[@REV]",
        help="instead of --corpus: pull a data dir `pretrainer push` uploaded and verify every file (into "
        "--out, or the hub cache without it)",
    )
    p.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2 (tiktoken GPT-2 BPE), bpe:N (train a BPE of vocab N) or hf:DIR_OR_REPO (a Hugging Face "
        "tokenizer.json: a local directory, or a hub repo id, read from the local hub cache offline)",
    )
    p.add_argument(
        "--eot-token",
        metavar="NAME",
        default="",
        help="hf: tokenizers: the token that ends each document (default: <|endoftext|>, <|end_of_text|>, "
        "</s>, <eos> or <|eos|> among its special tokens, else its post-processor's or config's eos)",
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="RUN_OR_DATA_DIR",
        help="reuse this run's (or data dir's) tokenizer exactly instead of --tokenizer (chat: plus the chat "
        "tokens)",
    )
    p.add_argument(
        "--format",
        default="text",
        choices=["text", "chat"],
        help="text: documents (a 'text' field/column); chat: conversations (a 'messages' list of {role, "
        "content} "
        "per JSONL line or parquet row) in the chat template, with a loss mask on the assistant's tokens",
    )
    p.add_argument(
        "--on-bad",
        default="error",
        choices=["error", "skip"],
        help="chat: a malformed conversation is an error naming file and line (default), or skipped and "
        "counted",
    )
    p.add_argument("--out", help="output data directory (must not exist unless --force)")
    p.add_argument(
        "--val-fraction", type=float, default=0.005, help="fraction of documents held out for validation"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document-level validation split")
    p.add_argument(
        "--workers", type=int, default=0, help="tokenizer processes (default: CPU count, at most 8)"
    )
    p.add_argument(
        "--txt-docs",
        default="auto",
        choices=["auto", "file", "blank-lines"],
        help=".txt documents: one per file, split on blank lines, or auto (one per file; files over 64 MiB "
        "are split on blank lines)",
    )
    p.add_argument(
        "--utf8-errors",
        default="replace",
        choices=["replace", "strict"],
        help="invalid UTF-8: replace with U+FFFD and count (default), or reject with an error",
    )
    p.add_argument("--max-docs", type=int, default=0, help="use only the first N documents (0 = all)")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it exists (only once the new data is complete)"
    )

    p = verbs.add_parser(
        "train",
        help="train a model; extra --section.key=value arguments override the config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=train_epilog(),
    )
    p.add_argument(
        "config",
        nargs="?",
        help="TOML config file (defaults for anything it leaves out); without one, "
        "--run.dir=R resumes R with its saved config",
    )
    p.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine: runs torchrun --standalone for you"
    )

    p = verbs.add_parser(
        "eval",
        help="validation loss and bits per byte, in-context tasks and prompt probes of a run's "
        "newest checkpoint, a checkpoint or hf:DIR weights",
        epilog="examples: pretrainer eval runs/tiny;  pretrainer eval hf:exports/gpt2 --data.dir=data/fw "
        "--tasks olmo:hellaswag --limit 0",
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir (its newest checkpoint and its data), a checkpoint dir, or hf:DIR; "
        "--section.key=value "
        "overrides follow (--data.dir=DIR, --eval.batches=N, ...)",
    )
    add_checkpoint_choice(p)
    p.add_argument(
        "--out",
        help="write the results as JSON here (default for a run's checkpoint: RUN_DIR/eval-STEP.json)",
    )
    p.add_argument(
        "--tasks",
        help="= --eval.tasks: comma-separated task files (JSONL, format in "
        "src/pretrainer/eval/task_files.py), "
        "olmo:TASK[/VARIANT] or a suite; default: the run's eval.tasks, else the olmes suite "
        "(needs the [eval] extra); none for none",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        help="= --eval.num_fewshot: examples from the same task before each item of "
        "our own task files (fixed seed)",
    )
    p.add_argument(
        "--limit", type=int, help="items per task, the first ones (default 500: SUITE_ITEMS); 0 = all"
    )

    p = verbs.add_parser(
        "plan",
        help="what a config will do: parameters, FLOPs, tokens, steps, time, cost and memory",
        epilog="example: pretrainer plan configs/gpt2-124m.toml --gpus 8 --gpu h100-sxm --data.dir=data/fw",
    )
    p.add_argument(
        "config",
        nargs="?",
        help="TOML config file; --section.key=value overrides follow (--data.dir=DIR "
        "takes the vocabulary from a prepared data dir; [budget] gives price and MFU)",
    )
    p.add_argument(
        "--tokens", type=float, help="plan this many training tokens instead of the config's train.max_steps"
    )
    p.add_argument(
        "--tokens-per-param",
        type=float,
        help="plan this many tokens per parameter (Chinchilla-optimal: 20) instead of train.max_steps",
    )
    p.add_argument("--gpus", type=int, default=1, help="data-parallel world size")
    p.add_argument(
        "--gpu",
        help="GPU model for time, cost, energy and memory: a100-40gb, a100-80gb, h100-sxm, h100-pcie, "
        "h200, b200, l4, l40s, rtx-3090, rtx-4090, a10 (others need --peak-tflops)",
    )
    p.add_argument(
        "--peak-tflops", type=float, help="dense bf16 peak per GPU (required for a GPU not in the table)"
    )
    p.add_argument("--gpu-memory-gb", type=float, help="memory per GPU (overrides the table)")
    p.add_argument("--gpu-watts", type=float, help="board power per GPU (overrides the table)")
    p.add_argument(
        "--mfu", type=float, help="model FLOPs utilisation assumed for the wall time (default: budget.mfu)"
    )
    p.add_argument(
        "--usd-per-gpu-hour",
        type=float,
        help="price for the cost estimate (default: budget.usd_per_gpu_hour)",
    )
    p.add_argument(
        "--flops",
        default="full",
        choices=["full", "6n"],
        help="full: 6 x matmul params + attention (default); 6n: 6 x non-embedding params (Kaplan/Chinchilla "
        "C=6ND)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--fit",
        help="a fit.json (pretrainer fit): also print the loss this run should reach, with its interval",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="time, $ and peak memory measured: train --measure-steps real steps of the config on this "
        "machine (one evaluation, one checkpoint) and plan the whole run from them",
    )
    p.add_argument("--measure-steps", type=int, default=30, help="steps of the --measure probe (default 30)")
    p.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        help="time and $ measured, not assumed: start-up, step, evaluation and checkpoint times from this "
        "run's metrics (on this hardware); without CONFIG, plans that run's own config",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also plan the run on every instance type of the price table: fits, micro-batch, hours, the "
        "whole bill, the cheapest marked",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        metavar="L",
        help="plan the tokens this model needs to reach validation loss L (nats/token) under the scaling "
        "law of --fit, else the published one (Hoffmann et al. 2022); with --compare, instances ranked "
        "by $ to reach it",
    )
    p.add_argument(
        "--prices",
        metavar="FILE",
        help="a TOML price table ([[instance]] name, gpu, count, usd_per_gpu_hour) replacing or adding rows "
        "of the built-in one (docs/planning.md)",
    )

    p = verbs.add_parser(
        "sweep",
        help="train a ladder of sizes from one base config (scaling laws); resumes where it stopped",
        epilog="examples: pretrainer sweep configs/sweep-tiny.toml --data.dir=data/stdlib-bpe4k;  "
        "pretrainer sweep configs/gpt2-124m.toml --sizes 5M,25M,100M --tokens 2e9 --out sweeps/lab "
        "--gpu h100-sxm --parallel-runs 3",
    )
    p.add_argument(
        "config",
        nargs="?",
        help="a sweep file ([sweep] section, format in src/pretrainer/analysis/scaling/ladder.py) or a "
        "base config; --sweep.key=value and --section.key=value overrides follow",
    )
    p.add_argument(
        "--sizes",
        help="= --sweep.sizes: target non-embedding parameters (1M,3M,10M) or shapes LAYERSxWIDTH (2x64)",
    )
    p.add_argument("--mode", help="= --sweep.mode: tokens, tokens_per_param or isoflop")
    p.add_argument(
        "--tokens", help="= --sweep.tokens: training tokens per run (comma-separated: each size at each)"
    )
    p.add_argument("--tokens-per-param", help="= --sweep.tokens_per_param (mode tokens_per_param)")
    p.add_argument("--budgets", help="= --sweep.budgets: compute budgets in FLOPs (mode isoflop)")
    p.add_argument("--out", help="= --sweep.dir: the sweep directory")
    p.add_argument(
        "--parallel-runs", help="= --sweep.parallel_runs: runs at once, one per GPU (or on the CPU)"
    )
    p.add_argument(
        "--cpu-threads",
        help="= --sweep.cpu_threads: torch threads per CPU run, wherever it runs (default 1; overrides "
        "OMP_NUM_THREADS)",
    )
    p.add_argument(
        "--gpu", help="= --sweep.gpu: GPU model for the plan's time and $ (budget.* gives price and MFU)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")

    p = verbs.add_parser(
        "fit", help="fit L(N, D) = E + A/N^a + B/D^b to a sweep, with bootstrap intervals and predictions"
    )
    p.add_argument(
        "sweep", metavar="SWEEP_DIR_OR_CSV", help="a sweep dir (its sweep.csv) or a CSV with the same columns"
    )
    p.add_argument("--out", help="where fit.json, fit.md and the plots go (default: next to the CSV)")
    p.add_argument(
        "--params",
        default="total",
        choices=["total", "non_embedding"],
        help="N counts total parameters (Hoffmann's convention, default) or non-embedding ones (Kaplan's)",
    )
    p.add_argument(
        "--form",
        default="auto",
        choices=["auto", "nd", "n", "d"],
        help="auto (the full law when the runs determine it, else the form they support), nd, n or d",
    )
    p.add_argument(
        "--predict-params",
        default="1e9",
        help="model sizes to predict compute-optimal tokens for (default 1e9)",
    )
    p.add_argument(
        "--predict-compute", help="compute budgets (FLOPs) to predict the optimal size and tokens for"
    )
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")

    p = verbs.add_parser(
        "export", help="the run's report, or its newest checkpoint as a model (hf / safetensors / gguf)"
    )
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir (its newest intact checkpoint) or a checkpoint dir",
    )
    add_checkpoint_choice(p)
    p.add_argument(
        "--format",
        default="report",
        choices=["report", "hf", "safetensors", "gguf"],
        help="report (default): manifest, metrics.csv, plots, final weights; hf: a transformers model "
        "directory; safetensors: one weights file with the config in its metadata; gguf: one llama.cpp "
        "file, weights and tokenizer",
    )
    p.add_argument(
        "--out",
        help="output directory (report, hf) or file (safetensors, gguf); default RUN_DIR/report, "
        "RUN_DIR/hf, RUN_DIR/model.safetensors or RUN_DIR/model-DTYPE.gguf",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --out if it exists (only once the new export is complete)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "f16", "q8_0"],
        help="weights' dtype: fp32 (default) or bf16 for hf / safetensors, f16 (default) or q8_0 for gguf "
        "(the report keeps the checkpoint's fp32 bytes)",
    )

    p = verbs.add_parser(
        "push",
        help="a prepared data dir, or a run as a Hugging Face export, to the Hugging Face Hub",
        epilog="examples: pretrainer push data/fw-gpt2 me/fw-gpt2;  "
        "pretrainer push runs/x1 me/x1-50m --dry-run",
    )
    p.add_argument("path", metavar="DATA_DIR_OR_RUN_DIR", help="a `pretrainer prepare` output or a run dir")
    p.add_argument(
        "repo_id", metavar="ORG/NAME", help="the Hub repo (a dataset repo for data, a model repo for a run)"
    )
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="a branch to push to (created if missing; default main)")
    p.add_argument(
        "--dtype", default="bf16", choices=["fp32", "bf16"], help="a run's exported weights (default bf16)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="stage the files, card and checksums in PATH/.hub-push only"
    )

    p = verbs.add_parser("sample", help="generate text from a run dir or checkpoint")
    add_generation_arguments(p, max_new_tokens=200, temperature=0.8)
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a document)")
    p.add_argument(
        "--num-samples", type=int, default=1, help="independent samples of the same prompt (default 1)"
    )

    p = verbs.add_parser(
        "chat",
        help="talk to a run fine-tuned on conversations (KV cache, history, streaming); "
        "with piped stdin it answers each line and exits",
        epilog='example: echo "What is 2+3?" | pretrainer chat runs/sft --max-new-tokens 20',
    )
    add_generation_arguments(p, max_new_tokens=256, temperature=0.6)
    p.add_argument("--system", default="", help="a system message that starts the conversation")

    p = verbs.add_parser(
        "serve-cost",
        help="what the model costs to serve: fp32/bf16 vs int8/int4 weight-only (torchao): "
        "load time, weight memory, prefill/decode tokens/s, $ per 1M tokens, quality cost",
        epilog="example: pretrainer serve-cost runs/tiny --usd-per-hour 0.10 --batch-sizes 1,8,32; writes "
        "RUN_DIR/report/serve_cost.json and serve_cost.md (needs pip install 'pretrainer[lowbit]')",
    )
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir (its newest intact checkpoint) or a checkpoint dir",
    )
    add_checkpoint_choice(p)
    p.add_argument(
        "--variants",
        help="comma-separated, the first is the baseline of the deltas: fp32, bf16, int8, int4 "
        "(default: fp32,bf16,int8,int4 on CPU; bf16,fp32,int8,int4 on CUDA)",
    )
    p.add_argument(
        "--batch-sizes", default="1,8,32", help="rows decoded at once, comma-separated (default 1,8,32)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=0, help="prefill length per row (default: model.seq_len / 2)"
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        help="greedy decode steps per row (default: 64, or what fits seq_len)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed rounds per batch size, the median reported (default 3)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument(
        "--usd-per-hour",
        type=float,
        help="the device's price: $ per million tokens at this rate (default: the "
        "run's budget.usd_per_gpu_hour, else 1.0, stated as assumed)",
    )
    p.add_argument(
        "--val-batches",
        type=int,
        default=8,
        help="validation batches for the loss and bits per byte (default 8)",
    )
    p.add_argument(
        "--tasks",
        default="",
        help="in-context tasks per variant, as for eval --tasks (a JSONL file, olmo:TASK, "
        "olmes); default none",
    )
    p.add_argument("--limit", type=int, default=100, help="items per task (default 100; 0 = all)")
    p.add_argument(
        "--group-size",
        type=int,
        default=32,
        help="int4: weights per scale and zero point, 32/64/128/256 (default 32)",
    )
    p.add_argument(
        "--data-dir",
        default="",
        help="score quality on this prepared data dir's val split (default: the run's)",
    )
    p.add_argument("--out", help="directory for serve_cost.json and serve_cost.md (default RUN_DIR/report)")
    p.add_argument(
        "--baseline",
        metavar="PATH",
        help="a local Hugging Face model folder (e.g. GPT-2 124M, SmolLM-135M) measured the same way: its "
        "rows in the same table, quality as bits per byte through its own tokenizer",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (default 0: torch's default, one per core)",
    )

    p = verbs.add_parser(
        "postmortem", help="write RUN_DIR/spike-postmortem.md and figures for every detected spike"
    )
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir, or one of its checkpoints (the run's is used)",
    )

    p = verbs.add_parser(
        "budget-check", help="check a budget.json against the guard's contract; --budget.* overrides follow"
    )
    p.add_argument("config", nargs="?", help="TOML config file (its [budget] section)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the decision and exit 0 (else exit with the trainer's code)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs, for the estimate")
    p.add_argument("--elapsed-hours", type=float, default=0.0, help="hours run so far, for the estimate")
    p.add_argument("--remaining-hours", type=float, default=0.0, help="hours still to run, for the estimate")

    p = verbs.add_parser("fetch-gpt2", help="download and verify the GPT-2 BPE ranks for offline use")
    p.add_argument(
        "--dest", help="where to write gpt2.tiktoken (default: $PRETRAINER_CACHE or ~/.cache/pretrainer)"
    )

    p = verbs.add_parser(
        "config", help="print the resolved config as TOML with each key's help; overrides follow"
    )
    p.add_argument("config", nargs="?", help="TOML config file (default: the built-in defaults)")
    return parser


def add_generation_arguments(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float) -> None:
    """What sample and chat share: the run, the sampling settings and the device."""
    p.add_argument(
        "run",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run dir (its newest intact checkpoint) or a checkpoint dir",
    )
    add_checkpoint_choice(p)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"tokens to generate per sample or reply (default {max_new_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"softmax temperature; 0 = greedy (default {temperature})",
    )
    p.add_argument(
        "--top-k", type=int, default=50, help="sample from the k most likely tokens; 0 = all (default 50)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the same seed and input give the same text (default 0)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."
    )


def train_epilog() -> str:
    from pretrainer.config.doc import keys_reference

    return (
        "example: pretrainer train configs/tiny-cpu.toml --optim.lr=3e-4 --train.max_steps=200\n\n"
        "config keys: --section.key=value overrides the TOML file's value; a bare boolean flag "
        "(--train.compile)\n"
        "means true; '-' and '_' are the same in keys. `pretrainer config CONFIG [overrides]` prints the "
        "resolved\n"
        "config with this help.\n\n" + keys_reference()
    )


def join_dotted_overrides(argv: list[str]) -> list[str]:
    """['--optim.lr', '3e-4'] -> ['--optim.lr=3e-4'], so a value is never taken for a positional argument.
    A boolean key takes the next word only when it is true/false/yes/no/on/off/1/0: `--train.compile CONFIG`
    is a bare flag."""
    from pretrainer.config.load import BOOL_WORDS, is_bool_key

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        dotted = arg.startswith("--") and "." in arg and "=" not in arg
        value = argv[i + 1] if dotted and i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if value is not None and (not is_bool_key(arg[2:]) or value.strip().lower() in BOOL_WORDS):
            out.append(f"{arg}={value}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def add_checkpoint_choice(p: argparse.ArgumentParser) -> None:
    """--checkpoint newest|best: which of a run dir's checkpoints a verb reads."""
    p.add_argument(
        "--checkpoint",
        choices=("newest", "best"),
        default="newest",
        help="of a run dir: its newest intact checkpoint (default) or the one with the lowest val loss "
        "(kept by ckpt.keep_best)",
    )
