"""The verbs that plan and scale: `plan`, `sweep`, `fit`, and `config` (the config with every key's help)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrainer.cli.output import print_to_stdout
from pretrainer.core.errors import UserError


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from pretrainer.analysis.plan import format_plan, make_plan
    from pretrainer.config.load import load_config

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
