"""serve_cost.md: `pretrainer serve-cost`'s result (pretrainer/analysis/serve_cost.py) as markdown tables:
weights
and quality per variant, speed and $ per batch size, and what was quantised and what was not."""

from __future__ import annotations


def format_tables(result: dict) -> str:
    """serve_cost.md: what was measured, how, and the numbers."""
    s = result["settings"]
    ran = [v for v in result["variants"] if v["status"] == "ok"]
    suite = any("suite_score" in v["quality"] for v in ran)
    lines = [
        f"# What it costs to serve: {result['run']} (step {result['step']})",
        "",
        f"{result['device']['name']}; torch {result['versions']['torch']}, torchao "
        f"{result['versions']['torchao']}. "
        f"Prompt {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens (greedy, KV cache); median of "
        f"{s['repeats']} "
        f"after {s['warmup']} warm-up. ${result['usd_per_hour']:g}/hour ({result['usd_per_hour_source']}).",
        "",
        f"Cost: {result['cost_assumption']}.",
        "",
        "## Weights and quality",
        "",
        f"Deltas are against {result['baseline']}; val loss (nats/token) and bits per byte over "
        f"{s['val_tokens']:,} tokens of {s['data_dir']}'s val split; top-1 agreement: positions of the first "
        f"val batch "
        f"({s['top1_positions']:,}) whose most likely next token is {result['baseline']}'s."
        + (
            " The open-weights baseline scores the same val text through its own tokenizer: its bits per "
            "byte compare, its nats per token do not (n/a)."
            if s.get("baseline")
            else ""
        ),
        "",
        "| variant | compute | weights | whole model vs fp32 | quantised layers vs fp32 | load s | quantise "
        "s | "
        "val loss (delta) | bits/byte (delta) | top-1 agreement |" + (" suite (delta) |" if suite else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if suite else ""),
    ]
    for v in result["variants"]:
        if v["status"] != "ok":
            continue
        w, q = v["weights"], v["quality"]
        quantised = w["quantised"]
        qcell = (
            f"{quantised['ratio_to_fp32']:.1%} ({quantised['layers']} layers)" if quantised["layers"] else "-"
        )
        row = (
            f"| {v['variant']} | {v['dtype']} | {mib(w['total_bytes'])} | {w['ratio_to_fp32']:.1%} | {qcell} "
            f"| "
            f"{v['load_s']:.2f} | {v.get('quantize_s', 0):.2f} | {q['val_loss']:.4f} "
            f"({signed(q['delta_val_loss'])}) | "
            f"{q['val_bpb']:.4f} ({signed(q['delta_val_bpb'])}) | "
            f"{'-' if q['top1_agreement'] is None else format(q['top1_agreement'], '.1%')} |"
        )
        if "suite_score" in q:
            row += f" {q['suite_score']:.4f} ({q['delta_suite_score']:+.4f}) |"
        lines.append(row)
    lines += [
        "",
        "## Speed and cost",
        "",
        "| variant | batch | prefill tokens/s | decode tokens/s | $ / 1M generated | $ / 1M prompt | KV "
        "cache |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in ran:
        for sp in v["speed"]:
            lines.append(
                f"| {v['variant']} | {sp['batch']} | {sp['prefill_tokens_per_s']:,.0f} | "
                f"{sp['decode_tokens_per_s']:,.0f} | {usd(sp['usd_per_million_generated'])} | "
                f"{usd(sp['usd_per_million_prompt'])} | {mib(sp['kv_cache_bytes'])} |"
            )
    skipped = [v for v in result["variants"] if v["status"] != "ok"]
    lines += ["", "## What was quantised, and what was not", ""]
    for v in ran:
        w = v["weights"]
        if not w["quantised"]["layers"]:
            continue
        lines.append(
            f"- {v['variant']}: {v['format']}: {w['quantised']['layers']} Linear layers, "
            f"{w['quantised']['params']:,} weights, {mib(w['quantised']['bytes'])} "
            f"(fp32: {mib(w['quantised']['fp32_bytes'])}). Unquantised, in {v['dtype']}:"
        )
        lines += [
            f"  - {g['what']}: {g['tensors']} tensor{'s' if g['tensors'] > 1 else ''}, {g['params']:,} "
            f"params, "
            f"{mib(g['bytes'])} ({g['why']})"
            for g in w["unquantised"]
        ]
    for v in skipped:
        lines.append(f"- {v['variant']}: skipped on this device: {v['reason']}")
    return "\n".join(lines) + "\n"


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def signed(delta: float | None) -> str:
    """A delta against the first variant; none where the units differ (another tokenizer's tokens)."""
    return "n/a" if delta is None else f"{delta:+.4f}"


def usd(x: float) -> str:
    return f"${x:.4f}" if x < 1 else f"${x:,.2f}"
