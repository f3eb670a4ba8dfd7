"""The verbs that plan and scale: `plan`, `sweep`, `fit`, and `config` (the config with every key's help)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrainer.cli.output import print_to_stdout
from pretrainer.core.errors import UserError


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from pretrainer.analysis.plan import make_plan
    from pretrainer.analysis.plan_text import format_plan
    from pretrainer.config.load import apply_overrides, load_config, load_saved_config

    timings = None
    config = args.config
    if args.from_run:
        from pretrainer.artifacts.metrics import run_timings

        timings = run_timings(Path(args.from_run))
        if config is None:  # the run's own config, resolved as it trained
            config = Path(args.from_run) / "config.toml"
    elif args.measure:
        from pretrainer.analysis.calibration import measure_probe

        timings = measure_probe(config, overrides, args.measure_steps, args.gpus)
    if args.from_run and args.config is None:  # a saved config: the keys it lacks take their values then
        cfg = apply_overrides(load_saved_config(config), overrides)
    else:
        cfg = load_config(config, overrides)
    data = data_for_vocab(cfg)
    target = None
    if args.target_loss is not None:  # the tokens this model needs to reach it, under a law
        target = tokens_for_target(cfg, data, args)
        args.tokens, args.tokens_per_param = target["tokens"], None
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
        data=data,
        timings=timings,
    )
    if args.measure:  # is the machine what it should be: matmul, memory copy, the run dir's disk
        from pretrainer.analysis.machine_check import machine_check

        plan["machine"] = machine_check(Path(cfg.run.dir), cfg.train.device)
        plan["warnings"] += plan["machine"]["warnings"]
    if args.fit:
        from pretrainer.analysis.scaling.report import predict_for_plan, read_fit

        plan["predicted_loss"] = predict_for_plan(
            read_fit(Path(args.fit)),
            plan["params_total"],
            plan["params_non_embedding"],
            plan["tokens_trained"],
        )
    if target is not None:
        plan["target_loss"] = target
    text = format_plan(plan)
    if target is not None:
        text += (
            f"\ntarget loss          {target['loss']:g} nats/token: {target['tokens']:,.0f} tokens for "
            f"N = {target['params']:,} under {target['law']}"
        )
    if args.compare:
        from pretrainer.analysis.instances import compare_instances, format_comparison, load_instances

        measured = plan.get("time_source") == "measured" and plan.get("mfu")  # carried by peak-FLOP ratio
        plan["compare"] = compare_instances(
            cfg,
            load_instances(args.prices),
            sequences_per_step=plan["tokens_per_step"] // cfg.model.seq_len,
            mfu=plan["mfu"] if measured else (args.mfu or cfg.budget.mfu),
            mfu_source=(
                f"measured on {plan['gpu']['name']}, carried by peak FLOP/s" if measured else "assumed"
            ),
            make_plan=make_plan,
            own_gpu=args.gpu,
            tokens=args.tokens,
            tokens_per_param=args.tokens_per_param,
            flops_convention=args.flops,
            data=data,
        )
        if target is not None:  # ranked by what reaching the loss costs
            plan["compare"].sort(key=lambda row: (not row["fits"], row.get("total_usd", 0.0)))
        what = f"to reach loss {target['loss']:g}" if target else "the same run"
        text += f"\n\ninstances ({what}: its tokens and global batch)\n" + format_comparison(plan["compare"])
    print_to_stdout(json.dumps(plan, indent=2) if args.json else text)


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
        "cpu_threads": args.cpu_threads,
        "gpu": args.gpu,
    }
    shorthands = [f"--sweep.{key}={value}" for key, value in flags.items() if value is not None]
    sweep, base = load_sweep(args.config, shorthands + overrides)
    if args.dry_run:
        from pretrainer.analysis.scaling.sweep_plan import cost_rows, format_plan, prepare_plan

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
        tokens=number(args.tokens, "--tokens") if args.tokens else None,
    )
    out = Path(args.out) if args.out else Path(fit["source"]).parent
    print_to_stdout(
        (out / "fit.md").read_text() + f"\nwrote {out}/fit.json, fit.md, {', '.join(fit['plots'])}"
    )


def data_for_vocab(cfg):
    """The data dir that supplies the vocabulary, if data.dir names one; a missing one is fine when
    model.vocab_size is set (plans are made before the data is prepared)."""
    from pretrainer.data.data_dir import open_training_data

    if not cfg.data.dir and not cfg.data.mixture:
        return None
    try:
        return open_training_data(cfg.data.dir, cfg.data.mixture)
    except UserError:
        if not cfg.model.vocab_size:
            raise
        print(
            f"note: {'data.dir = ' + cfg.data.dir if cfg.data.dir else 'data.mixture'} is not prepared data "
            f"yet; planning with model.vocab_size = {cfg.model.vocab_size}",
            file=sys.stderr,
        )
        return None


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the resolved config as TOML, each key's help as a comment: a starting point for a config file."""
    from pretrainer.config.doc import config_text_with_help
    from pretrainer.config.load import load_config

    cfg = load_config(args.config, overrides)
    try:  # the data decides model.vocab_size (and checks it); without the data it stays 0
        from pretrainer.config.resolve import resolve

        data = data_for_vocab(cfg)
        cfg = resolve(cfg, data=data, horizon=False) if data else cfg  # a template: any horizon
    except UserError as e:
        print(f"note: shown unresolved ({e})", file=sys.stderr)
    source = " ".join([args.config or "defaults", *overrides])
    print_to_stdout(f"# pretrainer config {source}\n\n{config_text_with_help(cfg)}")


def tokens_for_target(cfg, data, args: argparse.Namespace) -> dict:
    """plan --target-loss: the training tokens at which the law (--fit's, else the published one) says this
    model reaches the loss; an unreachable loss is an error naming the model's floor."""
    import math

    from pretrainer.analysis.plan import make_plan
    from pretrainer.analysis.scaling.fit import FIXED_D_FORMS, PUBLISHED_LAW, predict_loss, tokens_for_loss

    counts = make_plan(
        cfg, tokens=1, gpus=args.gpus, data=data
    )  # its parameters (the horizon is the target's)
    if args.fit:
        from pretrainer.analysis.scaling.report import law_from_json, read_fit

        fit = read_fit(Path(args.fit))
        if fit["form"] in FIXED_D_FORMS:
            raise UserError(
                f"{args.fit}: this fit holds D fixed ({fit['form']}): it cannot say how many tokens "
                f"reach a loss; fit a sweep with several token counts"
            )
        law, source = law_from_json(fit)[0], f"the fit {fit['source']}"
        params = counts["params_total"] if fit["params"] == "total" else counts["params_non_embedding"]
    else:
        law, source, params = (
            PUBLISHED_LAW,
            "the published law (Hoffmann et al. 2022)",
            counts["params_total"],
        )
    tokens = tokens_for_loss(law, params, args.target_loss)
    if not math.isfinite(tokens):
        floor = float(predict_loss(law, params, 1e30))
        raise UserError(
            f"plan --target-loss {args.target_loss:g}: {params:,} parameters do not reach it under {source} "
            f"(its floor for this model is {floor:.3f}); plan a larger model or a higher loss"
        )
    return {"loss": args.target_loss, "tokens": tokens, "params": params, "law": source}


# --- the command line's grammar for these verbs (cli/parser.py lists them) ---


def add_plan(verbs) -> None:
    """`pretrainer plan`'s arguments and help."""
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


def add_sweep(verbs) -> None:
    """`pretrainer sweep`'s arguments and help."""
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


def add_fit(verbs) -> None:
    """`pretrainer fit`'s arguments and help."""
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
    p.add_argument("--tokens", help="fit only the runs that trained this many tokens (e.g. with --form n)")


def add_config(verbs) -> None:
    """`pretrainer config`'s arguments and help."""
    p = verbs.add_parser(
        "config", help="print the resolved config as TOML with each key's help; overrides follow"
    )
    p.add_argument("config", nargs="?", help="TOML config file (default: the built-in defaults)")
