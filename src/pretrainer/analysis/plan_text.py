"""The plan for people: make_plan's numbers (analysis/plan.py) as the lines `pretrainer plan` prints."""

from __future__ import annotations

from pretrainer.analysis.costs import format_bill
from pretrainer.analysis.plan import CHINCHILLA_TOKENS_PER_PARAM
from pretrainer.config.resolve import horizon_line


def optimizer_line(plan: dict) -> str:
    """'muon, lr 0.005, 18 warm-up steps, cosine to 0.1 x lr'."""
    o = plan["lr_schedule"]
    decay = "constant" if o["schedule"] == "constant" else f"{o['schedule']} to {o['min_lr_ratio']:g} x lr"
    # warm-up "auto" stays unresolved only where the horizon's steps cannot be counted
    warmup = "auto warm-up" if o["warmup_steps"] < 0 else f"{o['warmup_steps']:,} warm-up steps"
    return f"{plan['optimizer']}, lr {o['lr']:g}, {warmup}, {decay}"


def format_plan(plan: dict) -> str:
    f, t, g = plan["flops_per_token_terms"], plan["tokens_per_step_terms"], plan["gpu"]
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    if plan["flops_convention"] == "full":
        flops_row = (
            f"{plan['flops_per_token']:,} = 6 x {f['n_matmul_params']:,} + {f['attention']:,} attention "
            f"(N = non-embedding parameters + output projection, a matmul even when tied)"
        )
    else:
        flops_row = (
            f"{plan['flops_per_token']:,} = 6 x {plan['params_non_embedding']:,} non-embedding parameters "
            f"(6N "
            f"convention; the full count incl. output projection and attention is "
            f"{plan['flops_per_token_full']:,})"
        )
    rows = [
        ("parameters (total)", f"{plan['params_total']:,}"),
        ("parameters (non-embedding)", f"{plan['params_non_embedding']:,}"),
        ("FLOPs per token", flops_row),
        (
            "tokens per optimizer step",
            f"{plan['tokens_per_step']:,} = {t['micro_batch']} micro-batch x {t['seq_len']} seq_len x "
            f"{t['grad_accum']} grad_accum x {t['world_size']} GPUs",
        ),
        (
            "steps",
            f"{plan['steps']:,} ({plan['token_budget_source']}) = {plan['tokens_trained']:,} training tokens",
        ),
        (
            "",
            f"the config trains {plan['configured_max_steps']:,} steps = {plan['configured_tokens']:,} tokens"
            if not plan["token_budget_source"].startswith(plan["horizon"]["key"])
            else "",
        ),
        ("horizon", horizon_line(plan["horizon"])),
        ("optimizer", optimizer_line(plan)),
        (
            "Chinchilla-optimal",
            f"{plan['chinchilla_tokens']:,} tokens ({CHINCHILLA_TOKENS_PER_PARAM} per parameter) = "
            f"{plan['chinchilla_steps']:,} steps; this plan trains "
            f"{plan['tokens_trained'] / plan['chinchilla_tokens']:.2f}x that",
        ),
        ("training FLOPs", f"{plan['training_flops']:.3e}"),
    ]
    if plan.get("time_source") == "measured":
        t_ = plan["measured"]

        def part(count: int, what: str, seconds: float | None) -> str:
            if seconds is None:  # "3 evaluations x not measured (0)" read as a broken sum
                return f"{count} {what} (0 s counted: the measured run had none to time)" if count else ""
            return f"{count} {what} x {seconds:,.2f} s"

        parts = [
            f"start-up {t_['startup_s']:,.1f} s",
            f"{plan['steps']:,} steps x {t_['step_s']:.4f} s",
            part(plan["evaluations"], "evaluations", t_["eval_s"]),
            part(plan["checkpoints"], "checkpoints", t_["checkpoint_s"]),
        ]
        rows += [
            (
                "wall time (measured)",
                f"{plan['wall_hours'] * 3600:,.1f} s = {plan['wall_hours']:,.3f} h: "
                + " + ".join(p for p in parts if p),
            ),
            (
                "  measured on",
                f"{t_['run_dir']} ({t_['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {plan['mfu']:.3f}" if plan["mfu"] else "")
                + f"; that run: {t_['run_steps']:,} steps in {t_['run_wall_s']:,.1f} s)",
            ),
        ]
        if "peak_memory_bytes" in t_:
            rows.append(
                ("peak memory (measured)", f"{gib(t_['peak_memory_bytes'])} ({t_['peak_memory_kind']})")
            )
        if "cost_usd" in plan:
            rows.append(
                (
                    "cost (measured time)",
                    f"${plan['cost_usd']:,.2f} at ${plan['usd_per_gpu_hour']:g}/GPU-hour",
                )
            )
    elif "wall_hours" in plan:
        rows += [
            ("GPU", f"{g['count']} x {g['name']} ({g['peak_bf16_tflops']:g} TFLOP/s bf16 peak)"),
            (
                "wall time (assumed MFU)",
                f"{plan['wall_hours']:,.2f} h at MFU {plan['mfu']:g} ({plan['tokens_per_s']:,.0f} tokens/s)",
            ),
        ]
        if "cost_usd" in plan:
            rows.append(("cost", f"${plan['cost_usd']:,.2f} at ${plan['usd_per_gpu_hour']:g}/GPU-hour"))
        if "energy_kwh" in plan:
            rows.append(
                ("energy", f"{plan['energy_kwh']:,.1f} kWh at {g['board_power_w']:g} W board power per GPU")
            )
    else:
        rows.append(
            (
                "wall time, cost",
                "plan --measure times a few real steps on this machine (a CPU too); or give --gpu NAME (or "
                "--peak-tflops) to estimate for a GPU",
            )
        )
    if "checkpointing" in plan:
        rows += checkpoint_rows(plan["checkpointing"], plan.get("usd_per_gpu_hour"), g["count"])
    if "bill" in plan:
        rows.append(("bill", f"the X1 lab's lines, at the {plan['time_source']} time"))
        rows += format_bill(plan["bill"], plan["usd_per_gpu_hour"])
    m = plan["memory_per_gpu_bytes"]
    rows += [
        (
            "memory per GPU",
            f"weights {gib(m['weights'])}, gradients {gib(m['gradients'])} (DDP buckets: views, +0), "
            f"{plan['optimizer']} "
            f"state {gib(m['optimizer'])} ({plan['strategy']})"
            + (f", CUDA context {gib(m['cuda_overhead'])}" if plan.get("device") != "cpu" else ""),
        ),
        (
            "  bf16 weights, loss",
            f"{gib(m['bf16_weights'])} bf16 weight copies; fused loss {gib(m['loss_gradient'])} "
            f"(output gradient) + {gib(m['loss_chunk'])} (one chunk of logits)",
        ),
        (
            "  activations",
            f"{gib(m['activations'])} at micro-batch {t['micro_batch']} -> total {gib(m['total'])}"
            + (
                f" ({'fits' if m['fits'] else 'does NOT fit'} in {g['memory_gb']:g} GB)"
                if "fits" in m
                else ""
            ),
        ),
        (
            "  with act. checkpointing",
            f"{gib(m['activations_checkpointed'])} -> total {gib(m['total_checkpointed'])}"
            + (f" ({'fits' if m['fits_checkpointed'] else 'does NOT fit'})" if "fits" in m else ""),
        ),
    ]
    if "max_micro_batch" in m:
        rows.append(
            (
                "  largest micro-batch",
                f"{m['max_micro_batch']} ({m['max_micro_batch_checkpointed']} with activation "
                f"checkpointing) in {g['memory_gb']:g} GB",
            )
        )
    if "predicted_loss" in plan:
        p = plan["predicted_loss"]
        loss = p["loss"]
        rows.append(
            (
                "predicted final loss",
                f"{loss['value']:.3f} ({loss['low']:.3f} to {loss['high']:.3f}, {p['level']:.0%} "
                f"interval) for N = {p['params']:,.0f}, D = {p['tokens']:,.0f}, from {p['source']}",
            )
        )
        rows += [("  note", note) for note in p["notes"]]
    if "machine" in plan:
        from pretrainer.analysis.machine_check import format_check

        rows += format_check(plan["machine"])
    rows += [("warning", warning) for warning in plan["warnings"]]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows if value)


def checkpoint_rows(c: dict, usd_per_gpu_hour: float | None, gpus: int) -> list[tuple[str, str]]:
    rows = [
        (
            "checkpoints",
            f"every {c['every']:,} steps ({c['every_source']}); each costs the training thread "
            f"{c['write_s']:,.2f} s ({c['write_source']}); start-up {c['startup_s']:,.0f} s "
            f"({c['startup_source']})",
        )
    ]
    if c["interruptions_per_hour"]:
        lost = f"{c['lost_s'] / 3600:,.2f} h of work"
        if usd_per_gpu_hour:
            lost += f" = ${c['lost_s'] / 3600 * gpus * usd_per_gpu_hour:,.2f}"
        rows.append(
            (
                "  interruptions",
                f"{c['interruptions']:,.1f} expected at {c['interruptions_per_hour']:g}/hour (declared): "
                f"{lost} lost (half an interval and a start-up each)",
            )
        )
    return rows
