"""The verbs that use a trained model: `eval`, `sample`, `chat`, `export`, `serve-cost`."""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrainer.cli.arguments import add_checkpoint_choice, add_generation_arguments
from pretrainer.cli.output import print_to_stdout
from pretrainer.core.errors import UserError
from pretrainer.core.files import check_output
from pretrainer.core.ownership import check_replaceable


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    from pretrainer.eval.verb import evaluate_target

    # the flags are shorthands for config keys (one source of truth), given before any explicit override
    shorthands = ([f"--eval.tasks={args.tasks}"] if args.tasks is not None else []) + (
        [f"--eval.num_fewshot={args.num_fewshot}"] if args.num_fewshot is not None else []
    )
    evaluate_target(args.target, shorthands + overrides, args.out, args.limit)


# the weights' dtypes each model format writes, its default first (the report keeps fp32 bytes)
EXPORT_DTYPES = {"hf": ("fp32", "bf16"), "safetensors": ("fp32", "bf16"), "gguf": ("f16", "q8_0")}


def export_dtype(fmt: str, dtype: str | None) -> str:
    """--dtype, or the format's default; one that the format does not write is an error."""
    allowed = EXPORT_DTYPES.get(fmt, ("fp32",))
    if dtype is not None and fmt in EXPORT_DTYPES and dtype not in allowed:
        raise UserError(f"--dtype {dtype}: --format {fmt} writes {' or '.join(allowed)}; pass one of those")
    return dtype or allowed[0]


def cmd_export(args: argparse.Namespace) -> None:
    from pretrainer.analysis.report.export import export_report, export_weights
    from pretrainer.artifacts.runs import open_run

    dtype = export_dtype(args.format, args.dtype)
    run = open_run(args.run)
    default_out = {
        "report": run.run_dir / "report",
        "hf": run.run_dir / "hf",
        "safetensors": run.run_dir / "model.safetensors",
        "gguf": run.run_dir / f"model-{dtype}.gguf",
    }
    out = Path(args.out) if args.out else default_out[args.format]
    if out.exists() and not args.force:
        raise UserError(
            f"{out}: already exists; pass --force to replace it (only once the new export is complete), "
            f"or --out elsewhere"
        )
    check_replaceable(out, args.format, keep=[run.checkpoint, run.run_dir])
    check_output(out, "file" if args.format in ("safetensors", "gguf") else "directory")  # before the export
    if args.format == "report":
        manifest = export_report(run, out)
        check = (
            "reloads byte-identically"
            if manifest["final_weights"]["reload_resave_byte_identical"]
            else "CHANGED on reload"
        )
        tables = [manifest["probes_table"]] if manifest["probes_table"] else []
        print(
            f"report: {out}/index.html (open it in a browser); manifest.json, metrics.csv, "
            f"{', '.join(manifest['plots'] + tables)}, final.safetensors: {check}"
        )
        return
    if args.format == "hf":
        from pretrainer.artifacts import hf_format as hf

        hf.export_hf(run.cfg.model, run.load_weights(), run.tokenizer(), out, dtype)
    elif args.format == "gguf":
        from pretrainer.artifacts.gguf_format import export_gguf

        name = f"{run.run_dir.name} step {run.step}"
        export_gguf(run.cfg.model, run.load_weights(), run.tokenizer(), out, dtype=dtype, name=name)
    else:
        export_weights(run, out, dtype)
    print(f"exported {run.checkpoint} (step {run.step}) as {args.format} ({dtype}) to {out}")


def cmd_sample(args: argparse.Namespace) -> None:
    import torch

    from pretrainer.model.generate import generate

    run, model, device = model_for_generation(args)
    tokenizer = run.tokenizer()

    # documents start after an end-of-text, or with the tokenizer's BOS where the data has one (hf:
    # tokenizers)
    prefix = [tokenizer.bos_id] if tokenizer.bos_id is not None else [] if args.prompt else [tokenizer.eot_id]
    prompt_ids = prefix + tokenizer.encode(args.prompt)
    refuse_what_cannot_sample(model, args.num_samples, len(prompt_ids), device)
    prompt = torch.tensor([prompt_ids] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with generation_precision(run, device):
        out = generate(
            model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=generator,
            vocab_in_use=tokenizer.vocab_size,
        )
    print(
        f"# {run.checkpoint} (step {run.step}), temperature {args.temperature}, top-k {args.top_k}, seed "
        f"{args.seed}"
    )
    for i, row in enumerate(out.tolist()):
        text = tokenizer.decode(row[len(prefix) :]).replace(tokenizer.eot_name, f"\n{tokenizer.eot_name}\n")
        print(f"--- sample {i + 1} ---\n{text}")


def refuse_what_cannot_sample(model, rows: int, prompt_len: int, device) -> None:
    """--num-samples so many that their KV cache cannot fit: one line before allocating (100,000,000 rows
    asked for 3.3 TB), as train refuses a shape that cannot fit."""
    from pretrainer.model.generate import generation_bytes
    from pretrainer.train.memory import device_memory_bytes

    needed, has = generation_bytes(model, rows, prompt_len), device_memory_bytes(device)
    if needed > has:
        raise UserError(
            f"--num-samples {rows:,}: sampling them at once needs about {needed / 1e9:,.1f} GB (the KV cache "
            f"and logits of {rows:,} rows) and {device.type} has {has / 1e9:,.1f} GB; ask for fewer"
        )


def model_for_generation(args: argparse.Namespace):
    """sample and chat: -> (the run, its newest intact checkpoint's model in eval mode on --device, the
    device)."""
    from pretrainer.artifacts.runs import build_model, open_run
    from pretrainer.core.device import resolve_device

    run = open_run(args.run)
    device = resolve_device(args.device)
    return run, build_model(run.cfg, run.load_weights, str(run.checkpoint)).to(device).eval(), device


def generation_precision(run, device):
    """sample and chat compute as the run trained: bf16 autocast on a CUDA GPU with bf16 (fp32 weights,
    fp32 RoPE tables and softmax), float32 elsewhere."""
    from pretrainer.core.device import autocast, autocast_dtype

    return autocast(device, autocast_dtype(run.cfg.train.dtype, device))


def cmd_chat(args: argparse.Namespace) -> None:
    from pretrainer.cli.chat import ChatSession, run_chat

    run, model, device = model_for_generation(args)
    session = ChatSession(
        model,
        run.tokenizer(),
        temperature=args.temperature,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        system=args.system,
    )
    with generation_precision(run, device):
        run_chat(session, conversation=args.conversation)


def cmd_serve_cost(args: argparse.Namespace) -> None:
    from pretrainer.analysis.serve_cost import ServeSettings, serve_cost

    def listed(text: str) -> list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]

    try:
        batch_sizes = [int(b) for b in listed(args.batch_sizes)]
    except ValueError:
        raise UserError(f"--batch-sizes: comma-separated integers, got '{args.batch_sizes}'") from None
    result = serve_cost(
        ServeSettings(
            args.run,
            variants=listed(args.variants or ""),
            batch_sizes=batch_sizes,
            prompt_tokens=args.prompt_tokens,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            val_batches=args.val_batches,
            group_size=args.group_size,
            usd_per_hour=args.usd_per_hour,
            tasks=args.tasks,
            task_limit=args.limit,
            device=args.device,
            threads=args.threads,
            data_dir=args.data_dir,
            baseline=args.baseline or "",
            out=args.out or "",
        )
    )
    print_to_stdout(Path(result["written"][1]).read_text() + f"\nwrote {', '.join(result['written'])}")


# --- the command line's grammar for these verbs (cli/parser.py lists them) ---


def add_eval(verbs) -> None:
    """`pretrainer eval`'s arguments and help."""
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


def add_export(verbs) -> None:
    """`pretrainer export`'s arguments and help."""
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


def add_sample(verbs) -> None:
    """`pretrainer sample`'s arguments and help."""
    p = verbs.add_parser("sample", help="generate text from a run dir or checkpoint")
    add_generation_arguments(p, max_new_tokens=200, temperature=0.8)
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a document)")
    p.add_argument(
        "--num-samples", type=int, default=1, help="independent samples of the same prompt (default 1)"
    )


def add_chat(verbs) -> None:
    """`pretrainer chat`'s arguments and help."""
    p = verbs.add_parser(
        "chat",
        help="talk to a run fine-tuned on conversations (KV cache, history, streaming); "
        "with piped stdin it answers each line, a conversation of its own, on one line and exits",
        epilog="example: pretrainer chat runs/sft --temperature 0 < prompts.txt > answers.txt",
    )
    add_generation_arguments(p, max_new_tokens=256, temperature=0.6)
    p.add_argument("--system", default="", help="a system message that starts the conversation")
    p.add_argument(
        "--conversation",
        action="store_true",
        help="with piped stdin: the lines are the turns of one conversation (default: each its own)",
    )


def add_serve_cost(verbs) -> None:
    """`pretrainer serve-cost`'s arguments and help."""
    p = verbs.add_parser(
        "serve-cost",
        help="what the model costs to serve: fp32/bf16 vs int8/int4 weight-only (torchao): "
        "load time, weight memory, prefill/decode tokens/s, $ per 1M tokens, quality cost",
        epilog="example: pretrainer serve-cost runs/tiny --usd-per-hour 0.10 --batch-sizes 1,8,32; writes "
        "RUN_DIR/report/serve_cost.json and serve_cost.md (torchao: pip install -e '.[lowbit]')",
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
