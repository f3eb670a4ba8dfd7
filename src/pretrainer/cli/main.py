"""pretrainer's command line: one verb per job. Each verb parses arguments, builds a config and
calls one function; user errors print one line (`error: ...`) and exit with code 2.

    pretrainer prepare --corpus stdlib --tokenizer bpe:4096 --out data/stdlib-bpe4k
    pretrainer train configs/tiny-cpu.toml --data.dir=data/stdlib-bpe4k --run.dir=runs/tiny
    pretrainer train --run.dir=runs/tiny                     # resume with the run's saved config
    pretrainer sample runs/tiny --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50
    pretrainer chat runs/sft                                 # talk to a model fine-tuned on conversations
    pretrainer eval runs/tiny                                # or a checkpoint, or hf:DIR --data.dir=DIR
    pretrainer export runs/tiny --format hf                  # -> runs/tiny/hf (default: the report,
    runs/tiny/report)
    pretrainer serve-cost runs/tiny --usd-per-hour 0.10      # fp32 vs int8/int4: memory, tokens/s, $/1M
    tokens, quality
    pretrainer plan configs/llama3-1b.toml --gpus 8 --gpu h100-sxm --data.dir=data/fw
    pretrainer sweep configs/sweep-tiny.toml --data.dir=data/stdlib-bpe4k   # a ladder of sizes
    pretrainer fit sweeps/tiny                               # scaling law, intervals, predictions
    pretrainer plan configs/llama3-1b.toml --fit sweeps/tiny/fit.json   # + the predicted final loss
    pretrainer fetch-gpt2
    pretrainer config configs/tiny-cpu.toml --optim.lr=1e-3
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pretrainer.cli.parser import build_parser, join_dotted_overrides
from pretrainer.core.errors import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_USER_ERROR,
    RunStopped,
    UserError,
    exit_code_for_signal,
)


def cmd_prepare(args: argparse.Namespace, argv: list[str]) -> None:
    from pretrainer.data.prepare import prepare
    from pretrainer.data.sources import Corpus

    corpus = Corpus(
        args.corpus,
        txt_docs=args.txt_docs,
        utf8_errors=args.utf8_errors,
        column="messages" if args.format == "chat" else "text",
        on_bad=args.on_bad,
    )
    prepare(
        corpus,
        args.tokenizer,
        Path(args.out),
        val_fraction=args.val_fraction,
        seed=args.seed,
        workers=args.workers,
        max_docs=args.max_docs,
        force=args.force,
        command="pretrainer " + shlex.join(argv),
        fmt=args.format,
        tokenizer_from=args.tokenizer_from or "",
        eot_token=args.eot_token,
    )


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from pretrainer.artifacts.run_config import load_train_config

    cfg = load_train_config(args.config, overrides)  # check the config before starting N processes
    if args.nproc > 1:
        from pretrainer.train.launch import launch

        sys.stdout.flush()
        return launch(
            args.nproc, cfg.parallel.shutdown_timeout_s, [*([args.config] if args.config else []), *overrides]
        )
    from pretrainer.train.loop import train

    train(cfg)
    return 0


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    from pretrainer.eval.verb import evaluate_target

    # the flags are shorthands for config keys (one source of truth), given before any explicit override
    shorthands = ([f"--eval.tasks={args.tasks}"] if args.tasks is not None else []) + (
        [f"--eval.num_fewshot={args.num_fewshot}"] if args.num_fewshot is not None else []
    )
    evaluate_target(args.target, shorthands + overrides, args.out, args.limit)


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from pretrainer.analysis.plan import format_plan, make_plan
    from pretrainer.config.load import load_config

    cfg = load_config(args.config, overrides)
    plan = make_plan(
        cfg,
        tokens=args.tokens,
        tokens_per_param=args.tokens_per_param,
        gpus=args.gpus,
        gpu=args.gpu,
        peak_tflops=args.peak_tflops,
        gpu_memory_gb=args.gpu_memory_gb,
        gpu_watts=args.gpu_watts,
        mfu=args.mfu,
        usd_per_gpu_hour=args.usd_per_gpu_hour,
        flops_convention=args.flops,
        data=data_for_vocab(cfg),
    )
    if args.fit:
        from pretrainer.analysis.scaling.report import predict_for_plan, read_fit

        plan["predicted_loss"] = predict_for_plan(
            read_fit(Path(args.fit)),
            plan["params_total"],
            plan["params_non_embedding"],
            plan["tokens_trained"],
        )
    print_to_stdout(json.dumps(plan, indent=2) if args.json else format_plan(plan))


def cmd_sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    from pretrainer.analysis.scaling.ladder import load_sweep
    from pretrainer.analysis.scaling.sweep import run_sweep

    # the flags are shorthands for sweep keys (one source of truth), given before any explicit override
    flags = {
        "sizes": args.sizes,
        "mode": args.mode,
        "tokens": args.tokens,
        "tokens_per_param": args.tokens_per_param,
        "budgets": args.budgets,
        "dir": args.out,
        "parallel_runs": args.parallel_runs,
        "gpu": args.gpu,
    }
    shorthands = [f"--sweep.{key}={value}" for key, value in flags.items() if value is not None]
    sweep, base = load_sweep(args.config, shorthands + overrides)
    if args.dry_run:
        from pretrainer.analysis.scaling.sweep import cost_rows, format_plan, prepare_plan

        _, runs = prepare_plan(sweep, base)
        print_to_stdout(format_plan(sweep, base, runs, *cost_rows(sweep, base, runs)))
        return 0
    return run_sweep(sweep, base)


def cmd_fit(args: argparse.Namespace) -> None:
    from pretrainer.analysis.scaling.ladder import listed, number
    from pretrainer.analysis.scaling.report import fit_sweep

    fit = fit_sweep(
        Path(args.sweep),
        Path(args.out) if args.out else None,
        params=args.params,
        form=args.form,
        resamples=args.resamples,
        seed=args.seed,
        predict_params=[number(n, "--predict-params") for n in listed(args.predict_params)],
        predict_compute=[number(c, "--predict-compute") for c in listed(args.predict_compute or "")],
    )
    out = Path(args.out) if args.out else Path(fit["source"]).parent
    print_to_stdout(
        (out / "fit.md").read_text() + f"\nwrote {out}/fit.json, fit.md, {', '.join(fit['plots'])}"
    )


def data_for_vocab(cfg):
    """The data dir that supplies the vocabulary, if data.dir names one; a missing one is fine when
    model.vocab_size is set (plans are made before the data is prepared)."""
    from pretrainer.data.loader import open_training_data

    if not cfg.data.dir and not cfg.data.mixture:
        return None
    try:
        return open_training_data(cfg.data.dir, cfg.data.mixture)
    except UserError:
        if not cfg.model.vocab_size:
            raise
        print(
            f"note: data.dir = {cfg.data.dir} is not a prepared data dir yet; planning with model.vocab_size "
            f"= "
            f"{cfg.model.vocab_size}",
            file=sys.stderr,
        )
        return None


def cmd_export(args: argparse.Namespace) -> None:
    from pretrainer.analysis.report.export import export_report, export_weights
    from pretrainer.artifacts.runs import open_run

    run = open_run(args.run)
    default_out = {
        "report": run.run_dir / "report",
        "hf": run.run_dir / "hf",
        "safetensors": run.run_dir / "model.safetensors",
    }
    out = Path(args.out) if args.out else default_out[args.format]
    if out.exists() and not args.force:
        raise UserError(
            f"{out}: already exists; pass --force to replace it (only once the new export is complete), "
            f"or --out elsewhere"
        )
    if args.format == "report":
        manifest = export_report(run, out)
        check = (
            "reloads byte-identically"
            if manifest["final_weights"]["reload_resave_byte_identical"]
            else "CHANGED on reload"
        )
        tables = [manifest["probes_table"]] if manifest["probes_table"] else []
        print(
            f"report: {out}/ (manifest.json, metrics.csv, {', '.join(manifest['plots'] + tables)}, "
            f"final.safetensors: {check})"
        )
        return
    if args.format == "hf":
        from pretrainer.artifacts import hf_format as hf

        hf.export_hf(run.cfg.model, run.load_weights(), run.tokenizer(), out, args.dtype)
    else:
        export_weights(run, out, args.dtype)
    print(f"exported {run.checkpoint} (step {run.step}) as {args.format} ({args.dtype}) to {out}")


def cmd_sample(args: argparse.Namespace) -> None:
    import torch

    from pretrainer.model.generate import generate

    run, model, device = model_for_generation(args)
    tokenizer = run.tokenizer()

    # documents start after an end-of-text, or with the tokenizer's BOS where the data has one (hf:
    # tokenizers)
    prefix = [tokenizer.bos_id] if tokenizer.bos_id is not None else [] if args.prompt else [tokenizer.eot_id]
    prompt_ids = prefix + tokenizer.encode(args.prompt)
    prompt = torch.tensor([prompt_ids] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator)
    print(
        f"# {run.checkpoint} (step {run.step}), temperature {args.temperature}, top-k {args.top_k}, seed "
        f"{args.seed}"
    )
    for i, row in enumerate(out.tolist()):
        text = tokenizer.decode(row[len(prefix) :]).replace(tokenizer.eot_name, f"\n{tokenizer.eot_name}\n")
        print(f"--- sample {i + 1} ---\n{text}")


def model_for_generation(args: argparse.Namespace):
    """sample and chat: -> (the run, its newest intact checkpoint's model in eval mode on --device, the
    device)."""
    from pretrainer.artifacts.runs import build_model, open_run
    from pretrainer.core.device import resolve_device

    run = open_run(args.run)
    device = resolve_device(args.device)
    return run, build_model(run.cfg, run.load_weights, str(run.checkpoint)).to(device).eval(), device


def cmd_chat(args: argparse.Namespace) -> None:
    from pretrainer.cli.chat import ChatSession, run_chat

    run, model, _ = model_for_generation(args)
    session = ChatSession(
        model, run.tokenizer(), args.temperature, args.top_k, args.max_new_tokens, args.seed, args.system
    )
    run_chat(session)


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
            out=args.out or "",
        )
    )
    print_to_stdout(Path(result["written"][1]).read_text() + f"\nwrote {', '.join(result['written'])}")


def cmd_budget_check(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the budget contract once against budget.json (or the estimate) and say what the trainer would
    do."""
    from pretrainer.config.load import load_config
    from pretrainer.train.budget import BudgetGuard

    cfg = load_config(args.config, overrides)
    if not cfg.budget.cap_usd:
        raise UserError("budget-check: set --budget.cap_usd (and --budget.file, --budget.usd_per_gpu_hour)")
    guard = BudgetGuard(cfg.budget, args.gpus)
    decision = guard.check(args.elapsed_hours * 3600, args.remaining_hours * 3600, force=True)
    reading = decision.reading
    if reading.problem:
        print(f"note: {reading.problem}")
    print(
        f"source: {'budget.json' if reading.source == 'file' else 'estimate'}; spent "
        f"${reading.spent_usd:.2f}, "
        f"projected ${reading.projected_total_usd:.2f}, rate ${reading.rate_usd_per_hr:.2f}/h; "
        f"warn at ${guard.warn_usd:.2f}, cap ${cfg.budget.cap_usd:.2f}"
    )
    effect = {
        "ok": "continue",
        "warn": "continue with a warning",
        "stop": "write a checkpoint, then exit",
        "halt": "exit at once, no checkpoint",
    }[decision.action]
    print(f"decision: {decision.action} -> the trainer would {effect} (exit code {decision.exit_code})")
    return 0 if args.dry_run else decision.exit_code


def cmd_postmortem(args: argparse.Namespace) -> None:
    from pretrainer.analysis.report.postmortem import write_postmortem

    path, _, summary = write_postmortem(Path(args.run))
    print(f"wrote {path}: {summary}")


def cmd_fetch_gpt2(args: argparse.Namespace) -> None:
    from pretrainer.data.tokenizers.bpe import fetch_gpt2_ranks

    path = fetch_gpt2_ranks(Path(args.dest) if args.dest else None)
    print(f"GPT-2 ranks ready at {path} (sha256 verified)")


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the resolved config as TOML, each key's help as a comment: a starting point for a config file."""
    from pretrainer.config.doc import config_text_with_help
    from pretrainer.config.load import load_config

    cfg = load_config(args.config, overrides)
    try:  # the data decides model.vocab_size (and checks it); without the data it stays 0
        from pretrainer.config.resolve import resolve

        data = data_for_vocab(cfg)
        cfg = resolve(cfg, data=data) if data else cfg
    except UserError as e:
        print(f"note: shown unresolved ({e})", file=sys.stderr)
    source = " ".join([args.config or "defaults", *overrides])
    print_to_stdout(f"# pretrainer config {source}\n\n{config_text_with_help(cfg)}")


def print_to_stdout(text: str) -> None:
    """Print text; a reader that stops early (`pretrainer config | head -3`) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's docs (signal, "Note on SIGPIPE"): point stdout at devnull so the flush at exit does not
        # fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = join_dotted_overrides(sys.argv[1:] if argv is None else [str(a) for a in argv])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.verb not in ("train", "eval", "plan", "budget-check", "config", "sweep"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.verb == "prepare":
            cmd_prepare(args, argv)
        elif args.verb == "train":
            return cmd_train(args, extra)
        elif args.verb == "eval":
            cmd_eval(args, extra)
        elif args.verb == "plan":
            cmd_plan(args, extra)
        elif args.verb == "sweep":
            return cmd_sweep(args, extra)
        elif args.verb == "fit":
            cmd_fit(args)
        elif args.verb == "export":
            cmd_export(args)
        elif args.verb == "sample":
            cmd_sample(args)
        elif args.verb == "chat":
            cmd_chat(args)
        elif args.verb == "serve-cost":
            cmd_serve_cost(args)
        elif args.verb == "postmortem":
            cmd_postmortem(args)
        elif args.verb == "budget-check":
            return cmd_budget_check(args, extra)
        elif args.verb == "fetch-gpt2":
            cmd_fetch_gpt2(args)
        elif args.verb == "config":
            cmd_config(args, extra)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        import signal

        print("interrupted", file=sys.stderr)
        return exit_code_for_signal(signal.SIGINT)
    except Exception as e:
        from pretrainer.train.distributed import is_collective_timeout

        if not is_collective_timeout(e):
            raise
        print(
            f"error: a collective operation timed out (parallel.timeout_s): a rank is stuck, dead or "
            f"unreachable. "
            f"Check every rank's log; on cloud GPUs without NVLink/InfiniBand try NCCL_P2P_DISABLE=1 "
            f"NCCL_IB_DISABLE=1, "
            f"and NCCL_DEBUG=INFO to see the transport. ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
            file=sys.stderr,
        )
        return EXIT_COLLECTIVE_TIMEOUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
