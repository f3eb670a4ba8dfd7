"""The fit for people: fit.md (the law with its intervals, the predictions, the IsoFLOP minima) and the
figure of the points with the fitted curves; analysis/scaling/report.py computes what they show."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pretrainer.analysis.scaling import fit as F
from pretrainer.core.files import save_figure


def constant_text(name: str, value: float | None) -> str:
    """log_A -> A's value, as e^x when it is beyond a float's range."""
    if name.startswith("log_"):
        return sci(math.exp(value)) if value < 700 else f"e^{value:.1f}"
    return sci(value)


def sci(x: float) -> str:
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def span(s: dict) -> str:
    undefined = (
        f"; undefined in {s['undefined_share']:.0%} of resamples"
        if s.get("undefined_share", 0) > 0.05
        else ""
    )
    return f"{sci(s['value'])} ({sci(s['low'])} to {sci(s['high'])}{undefined})"


def fit_markdown(fit: dict) -> str:
    level = f"{fit['level']:.0%}"
    law = fit["law"]
    n_name = "N = total parameters" if fit["params"] == "total" else "N = non-embedding parameters"
    lines = [
        f"# Scaling-law fit of {fit['source']}",
        "",
        f"{len(fit['points'])} runs; {fit['form_text']} with {n_name}, D = training tokens, L = final "
        f"validation loss "
        f"(nats per token). Huber (delta {F.HUBER_DELTA:g}) on log-loss, L-BFGS from a grid; intervals are "
        f"the central "
        f"{level} of {fit['bootstrap']['used']} bootstrap refits over runs.",
        "",
    ]
    if fit["fallback"]:
        lines += [f"**Fallback:** {fit['fallback']}; fitted {fit['form_text']} instead of the full law.", ""]
    if fit["problems"]:
        lines += [f"**Not determined:** {'; '.join(fit['problems'])}.", ""]
    if fit.get("weakly_determined"):
        lines += [
            f"**Weakly determined:** {'; '.join(fit['weakly_determined'])}. The predictions below "
            f"extrapolate with "
            f"that uncertainty (see their intervals); runs with more tokens, or sizes further apart, pin the "
            f"law.",
            "",
        ]
    lines += ["| constant | fit | " + f"{level} interval |", "|---|---|---|"]
    lines += [
        f"| {k.removeprefix('log_')} | {constant_text(k, law[k])} | {constant_text(k, lo)} to "
        f"{constant_text(k, hi)} |"
        for k, (lo, hi) in fit["intervals"].items()
    ]
    lines.append("")
    for p in fit["predictions"]:
        if p["kind"] == "optimal_for_params":
            lines.append(
                f"- **A {sci(p['params'])}-parameter model** is compute-optimal at **{span(p['tokens'])} "
                f"tokens** "
                f"({span(p['tokens_per_param'])} tokens per parameter, {level} interval), costing "
                f"{span(p['compute'])} FLOPs (C = 6ND) and reaching a loss of {span(p['loss'])}."
            )
        elif p["kind"] == "optimal_for_compute":
            lines.append(
                f"- **{sci(p['compute'])} FLOPs** are best spent on {span(p['params'])} parameters and "
                f"{span(p['tokens'])} tokens ({span(p['tokens_per_param'])} per parameter), for a loss of "
                f"{span(p['loss'])}."
            )
        else:
            lines.append(
                f"- A {sci(p['params'])}-parameter model trained on {sci(p['tokens'])} tokens should reach a "
                f"loss of "
                f"{span(p['loss'])}."
            )
    if fit["no_compute_optimal"]:
        lines.append(f"- No compute-optimal prediction: {fit['no_compute_optimal']}.")
    iso = fit["isoflop"]
    if iso:
        lines += ["", "## IsoFLOP profiles", ""]
        for m in iso["minima"]:
            lines.append(
                f"- {sci(m['budget_flops'])} FLOPs: "
                + (
                    m["problem"]
                    if "problem" in m
                    else f"minimum at N = {sci(m['params_opt'])}, D = {sci(m['tokens_opt'])}, loss "
                    f"{m['loss_opt']:.4f}"
                    + ("" if m["bracketed"] else " (outside the sizes tried: extrapolated)")
                )
            )
        if "problem" in iso:
            lines.append(f"- {iso['problem']}")
        else:
            lines.append(
                f"- N_opt proportional to C^{span(iso['a'])}, D_opt to C^{span(iso['b'])}; here C is the "
                f"sweep's "
                f"FLOPs (6 x matmul parameters + attention, per token), not the 6ND above."
            )
            for p in iso["predictions"]:
                given = (
                    f"a budget of {sci(p['value'])} FLOPs"
                    if p["given"] == "compute"
                    else f"N = {sci(p['value'])}"
                )
                lines.append(
                    f"- For {given}: "
                    f"N_opt {span(p['params'])}, D_opt {span(p['tokens'])} ({span(p['tokens_per_param'])} "
                    f"tokens per "
                    f"parameter), C {span(p['compute'])}."
                )
    lines += [
        "",
        "These hold for this data, tokenizer, sequence length and recipe; a prediction far outside the sizes "
        "and "
        "token counts of the runs is an extrapolation, and the interval covers the fit's noise, not that.",
        "",
        "Plots: " + ", ".join(fit["plots"]),
    ]
    return "\n".join(lines) + "\n"


def plot_fit(fit: dict, points: F.Points, laws: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law, written = fit["law"], []
    # curves reach the predictions
    asked = [p["params"] for p in fit["predictions"] if isinstance(p.get("params"), float)]
    grid = np.geomspace(points.params.min() / 2, max([points.params.max() * 2, *asked]), 100)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    token_counts = np.unique(points.tokens)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(token_counts)))
    series = [(d, c) for d, c in zip(token_counts, colors)] if len(token_counts) <= 8 else []
    for d, color in series:
        rows = points.tokens == d
        ax.scatter(points.params[rows], points.loss[rows], color=color, zorder=3, label=f"D = {sci(d)}")
        if fit["form"] != "d":
            curves = np.array([F.predict_loss(x, grid, d) for x in laws])
            low, high = np.percentile(curves, [(1 - F.LEVEL) / 2 * 100, (1 + F.LEVEL) / 2 * 100], axis=0)
            ax.plot(grid, F.predict_loss(law, grid, d), color=color)
            ax.fill_between(grid, low, high, color=color, alpha=0.2)
    if not series:
        ax.scatter(points.params, points.loss, c=np.log(points.tokens), zorder=3)
    # the runs set the scale: a wide band (a poorly determined law) is cut off rather than flattening the
    # points
    lowest = (
        min(points.loss.min(), *(F.predict_loss(law, grid, d).min() for d, _ in series))
        if fit["form"] != "d" and series
        else points.loss.min()
    )
    ax.set(
        xscale="log",
        xlabel=f"N ({fit['params']} parameters)",
        ylabel="final validation loss",
        title=f"{fit['form_text']} ({F.LEVEL:.0%} bands)",
        ylim=(max(0.0, 0.9 * lowest), 1.2 * points.loss.max()),
    )
    ax.legend(fontsize=8)
    save_figure(fig, out / "scaling.png")
    written.append("scaling.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    residuals = np.log(points.loss) - np.log(F.predict_loss(law, points.params, points.tokens))
    ax.scatter(points.params, residuals, c=np.log(points.tokens))
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="N", ylabel="log L - log L_fit", title="residuals (colour: log D)")
    save_figure(fig, out / "residuals.png")
    written.append("residuals.png")

    iso = fit["isoflop"]
    if iso:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = plt.cm.plasma(np.linspace(0, 0.85, len(iso["minima"])))
        for m, color in zip(iso["minima"], colors):
            rows = points.budgets == m["budget_flops"]
            ax.scatter(
                points.params[rows], points.loss[rows], color=color, label=f"C = {sci(m['budget_flops'])}"
            )
            if "parabola" in m:
                xs = np.geomspace(points.params[rows].min(), points.params[rows].max(), 50)
                ax.plot(xs, np.polyval(m["parabola"], np.log(xs)), color=color)
                ax.scatter(
                    [m["params_opt"]],
                    [m["loss_opt"]],
                    color=color,
                    marker="*",
                    s=150,
                    edgecolor="black",
                    zorder=4,
                )
        ax.set(
            xscale="log", xlabel="N", ylabel="final validation loss", title="IsoFLOP profiles (stars: minima)"
        )
        ax.legend(fontsize=8)
        save_figure(fig, out / "isoflop.png")
        written.append("isoflop.png")
    return written
