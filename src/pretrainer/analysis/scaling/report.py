"""`pretrainer fit`: a sweep's CSV -> fit.json, fit.md and plots, and the predictions `plan --fit` reads.

    fit = fit_sweep(Path("sweeps/tiny"), Path("sweeps/tiny/fit"))   # the sweep dir or its sweep.csv

fit.json holds the law, its bootstrap intervals, every resample's constants (so `plan --fit` can
put an interval on any (N, D)), the IsoFLOP minima and power laws when the sweep has budgets, and
the predictions; fit.md says the same in sentences. Plots: loss against N per token count with the
fitted curves and their bands (scaling.png), IsoFLOP profiles with their minima (isoflop.png) and
residuals (residuals.png).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from pretrainer.analysis.scaling import fit as F
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes, atomic_write_json, save_figure

PARAMS_COLUMNS = {"total": "params_total", "non_embedding": "params_non_embedding"}


def read_points(source: Path, params: str) -> tuple[F.Points, Path]:
    """sweep.csv (or a sweep dir holding one) -> the points, and the CSV's path."""
    path = source / "sweep.csv" if source.is_dir() else source
    if not path.is_file():
        raise UserError(
            f"{path}: not found; give a sweep dir (pretrainer sweep writes DIR/sweep.csv) or a CSV with "
            f"columns run, params_total, params_non_embedding, tokens, val_loss (budget_flops for IsoFLOP)"
        )
    if params not in PARAMS_COLUMNS:
        raise UserError(f"fit: --params must be total or non_embedding, got '{params}'")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    needed = ["run", PARAMS_COLUMNS[params], "tokens", "val_loss"]
    missing = [c for c in needed if rows and c not in rows[0]]
    if not rows or missing:
        raise UserError(
            f"{path}: " + (f"missing columns {', '.join(missing)}" if rows else "no finished runs yet")
        )
    try:
        values = {c: np.array([float(r[c]) for r in rows]) for c in needed[1:]}
        budgets = np.array([float(r.get("budget_flops") or 0) for r in rows])
        flops = np.array([float(r["flops"]) for r in rows]) if "flops" in rows[0] else None
    except ValueError as e:
        raise UserError(f"{path}: a value is not a number ({e})") from None
    if not np.all(np.isfinite(values["val_loss"])) or np.any(values["val_loss"] <= 0):
        raise UserError(
            f"{path}: val_loss must be finite and positive in every row (a diverged run? leave it out)"
        )
    return F.Points(
        values[PARAMS_COLUMNS[params]],
        values["tokens"],
        values["val_loss"],
        [r["run"] for r in rows],
        budgets if np.any(budgets > 0) else None,
        flops,
    ), path


def summary(values: list[float], point: float) -> dict:
    """A point value, its interval, and the share of resamples where it does not exist (no optimum):
    left out of the interval, and said when it is more than 5%."""
    low, high = F.interval(values)
    values = np.asarray(values, dtype=float)
    return {
        "value": point,
        "low": low,
        "high": high,
        "undefined_share": float(np.mean(~np.isfinite(values))) if len(values) else 1.0,
    }


def predictions(
    law: dict,
    laws: list[dict],
    form: str,
    points: F.Points,
    *,
    predict_params: list[float],
    predict_compute: list[float],
) -> tuple[list[dict], str]:
    """What the law says for the asked sizes and budgets -> (predictions, why compute-optimal ones are
    missing)."""
    out = []
    if form in F.FIXED_D_FORMS:
        tokens = float(points.tokens[0])
        for n in predict_params:
            out.append(
                {
                    "kind": "loss",
                    "params": n,
                    "tokens": tokens,
                    "loss": summary(
                        [F.predict_loss(x, n, tokens) for x in laws], float(F.predict_loss(law, n, tokens))
                    ),
                }
            )
        return out, (
            f"the runs share one token count ({tokens:,.0f}): the law has no D-term, so there is no "
            f"compute-optimal "
            f"allocation to predict; add runs at other token counts"
        )
    if form == "d":
        return out, "the runs share one size: no N-term, so no compute-optimal allocation; add sizes"
    for n in predict_params:
        tokens = [F.optimal_tokens_for_params(x, n) for x in laws]
        d = F.optimal_tokens_for_params(law, n)
        out.append(
            {
                "kind": "optimal_for_params",
                "params": n,
                "tokens": summary(tokens, d),
                "tokens_per_param": summary([t / n for t in tokens], d / n),
                "compute": summary([6 * n * t for t in tokens], 6 * n * d),
                "loss": summary(
                    [F.predict_loss(x, n, t) for x, t in zip(laws, tokens)], float(F.predict_loss(law, n, d))
                ),
            }
        )
    for c in predict_compute:
        pairs = [F.optimal_for_compute(x, c) for x in laws]
        n, d = F.optimal_for_compute(law, c)
        out.append(
            {
                "kind": "optimal_for_compute",
                "compute": c,
                "params": summary([p[0] for p in pairs], n),
                "tokens": summary([p[1] for p in pairs], d),
                "tokens_per_param": summary([p[1] / p[0] for p in pairs], d / n),
                "loss": summary(
                    [F.predict_loss(x, *p) for x, p in zip(laws, pairs)], float(F.predict_loss(law, n, d))
                ),
            }
        )
    return out, ""


def undetermined(law: dict, form: str) -> list[str]:
    """Exponents outside (0, MAX_EXPONENT) mean the runs did not show a power law in that variable."""
    problems = []
    for name, variable in (("alpha", "N"), ("beta", "D")):
        if name == "alpha" and form == "d" or name == "beta" and form in F.FIXED_D_FORMS:
            continue
        if not 0 < law[name] < F.MAX_EXPONENT:
            problems.append(
                f"{name} = {law[name]:.3g}: the loss does not fall as a power of {variable} over these runs "
                + (
                    "(the sizes barely differ at these token counts: too few tokens per run for the models "
                    "to "
                    "separate, or sizes too close; train longer)"
                    if variable == "N"
                    else "(the token counts are too close, or the runs too noisy)"
                )
            )
    return problems


def isoflop_analysis(
    points: F.Points, resamples: int, seed: int, predict_params: list[float], predict_compute: list[float]
) -> dict | None:
    if points.budgets is None:
        return None
    minima = F.isoflop_minima(points)
    power = F.isoflop_power_laws(minima)
    result = {"minima": minima, "power_laws": power}
    if power is None:
        result["problem"] = (
            "fewer than 2 budgets have a loss minimum inside a parabola: no N_opt(C) power law "
            "(each budget needs 3 sizes that bracket its optimum)"
        )
        return result
    samples, skipped = F.bootstrap_isoflop(points, power["budgets"], resamples, seed)
    if len(samples) < resamples / 2:
        result["problem"] = (
            f"only {len(samples)} of {resamples} resamples keep a minimum in every budget: too few sizes per "
            f"budget for an interval (add sizes around each budget's optimum)"
        )
        return result
    result.update(
        {
            "bootstrap": {"resamples": resamples, "used": len(samples), "skipped": skipped},
            "a": summary([s["a"] for s in samples], power["a"]),
            "b": summary([s["b"] for s in samples], power["b"]),
        }
    )
    asked = [("compute", c) for c in predict_compute] + [("params", n) for n in predict_params]
    result["predictions"] = []
    for kind, value in asked:
        point = F.isoflop_at(power, **{kind: value})
        each = [F.isoflop_at(s, **{kind: value}) for s in samples]
        result["predictions"].append(
            {
                "given": kind,
                "value": value,
                "compute": summary([e[0] for e in each], point[0]),
                "params": summary([e[1] for e in each], point[1]),
                "tokens": summary([e[2] for e in each], point[2]),
                "tokens_per_param": summary([e[2] / e[1] for e in each], point[2] / point[1]),
            }
        )
    return result


def fit_sweep(
    source: Path,
    out: Path | None = None,
    *,
    params: str = "total",
    form: str = "auto",
    resamples: int = F.RESAMPLES,
    seed: int = 0,
    predict_params: list[float] = (1e9,),
    predict_compute: list[float] = (),
) -> dict:
    """Fit the sweep's CSV; write fit.json, fit.md and the plots into `out` (default: next to the CSV)."""
    points, csv_path = read_points(source, params)
    out = out or csv_path.parent
    if resamples < 1:
        raise UserError(
            f"fit: --resamples must be at least 1 (the issue's intervals use >= {F.RESAMPLES}), got "
            f"{resamples}"
        )
    form, fallback = F.choose_form(points, form)
    theta, objective = F.fit_law(points, form)
    law = F.constants(theta, form)
    laws, skipped = F.bootstrap_laws(points, form, theta, resamples, seed)
    if len(laws) < resamples / 2:
        raise UserError(
            f"fit: only {len(laws)} of {resamples} resamples could determine {F.FORM_TEXT[form]}: too few "
            f"distinct runs for an interval; add runs"
        )
    problems = undetermined(law, form)
    free = {
        "nd": F.NAMES,
        "n": ("E", "log_A", "alpha"),
        "d": ("E", "log_B", "beta"),
        "n_power": ("log_A", "alpha"),
    }[form]
    predicted, no_optimum = predictions(
        law, laws, form, points, predict_params=list(predict_params), predict_compute=list(predict_compute)
    )
    if problems:  # a law with a meaningless exponent predicts anything: say why instead of printing it
        predicted = [p for p in predicted if p["kind"] == "loss"]
        no_optimum = "the fit does not determine the law: " + "; ".join(problems)
    intervals = {k: F.interval([x[k] for x in laws]) for k in free}
    loose = [
        f"{name}'s {F.LEVEL:.0%} interval ({intervals[name][0]:.3g} to {intervals[name][1]:.3g}) reaches "
        f"past "
        f"{F.MAX_EXPONENT}: resamples of these runs fit laws of any steepness in {variable}"
        for name, variable in (("alpha", "N"), ("beta", "D"))
        if name in intervals and not problems and intervals[name][1] > F.MAX_EXPONENT
    ]
    fitted = F.predict_loss(law, points.params, points.tokens)
    result = {
        "source": str(csv_path),
        "params": params,
        "form": form,
        "form_text": F.FORM_TEXT[form],
        "fallback": fallback,
        "law": law,
        "objective": objective,
        "level": F.LEVEL,
        "problems": problems,
        "weakly_determined": loose,
        "intervals": intervals,
        "bootstrap": {
            "resamples": resamples,
            "used": len(laws),
            "skipped": skipped,
            "seed": seed,
            "laws": [[x[k] for k in F.NAMES] for x in laws],
        },
        "fixed": (
            {"tokens": float(points.tokens[0])}
            if form in F.FIXED_D_FORMS
            else {"params": float(points.params[0])}
            if form == "d"
            else {}
        ),
        "points": [
            {"run": r, "params": float(n), "tokens": float(d), "loss": float(loss), "fitted": float(f)}
            for r, n, d, loss, f in zip(points.runs, points.params, points.tokens, points.loss, fitted)
        ],
        "predictions": predicted,
        "no_compute_optimal": no_optimum,
        "isoflop": isoflop_analysis(points, resamples, seed, list(predict_params), list(predict_compute)),
    }
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot_fit(result, points, laws, out)
    atomic_write_json(out / "fit.json", result)
    atomic_write_bytes(out / "fit.md", fit_markdown(result).encode())
    return result


def read_fit(path: Path) -> dict:
    import json

    path = path / "fit.json" if path.is_dir() else path
    try:
        fit = json.loads(path.read_text())
        # the keys predictions need
        fit["law"], fit["bootstrap"]["laws"], fit["form"], fit["params"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path}: not a fit.json written by `pretrainer fit` ({type(e).__name__}: {e})"
        ) from None
    return fit


def law_from_json(fit: dict) -> tuple[dict, list[dict]]:
    return fit["law"], [dict(zip(F.NAMES, row)) for row in fit["bootstrap"]["laws"]]


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


def predict_for_plan(fit: dict, params_total: int, params_non_embedding: int, tokens: float) -> dict:
    """The loss a planned run should reach under a fit.json, with its interval, and a caveat when the
    plan lies outside what the fit can speak for."""
    n = params_total if fit["params"] == "total" else params_non_embedding
    law, laws = law_from_json(fit)
    notes = []
    if fit["form"] in F.FIXED_D_FORMS and not math.isclose(tokens, fit["fixed"]["tokens"], rel_tol=0.01):
        notes.append(
            f"the fit holds D fixed at {fit['fixed']['tokens']:,.0f} tokens; this run trains {tokens:,.0f}: "
            f"the "
            f"prediction is for D = {fit['fixed']['tokens']:,.0f}"
        )
        tokens = fit["fixed"]["tokens"]
    if fit["form"] == "d" and not math.isclose(n, fit["fixed"]["params"], rel_tol=0.01):
        notes.append(f"the fit holds N fixed at {fit['fixed']['params']:,.0f}; the prediction is for that N")
        n = fit["fixed"]["params"]
    sizes = [p["params"] for p in fit["points"]]
    if n > 10 * max(sizes):
        notes.append(f"N = {n:,.0f} is {n / max(sizes):.0f}x the largest run of the fit: an extrapolation")
    notes += [f"{fit['source']}: not determined: {problem}" for problem in fit.get("problems", [])]
    values = [F.predict_loss(x, n, tokens) for x in laws]
    return {
        "params": n,
        "tokens": tokens,
        "loss": summary(values, float(F.predict_loss(law, n, tokens))),
        "notes": notes,
        "level": fit["level"],
        "source": fit["source"],
    }
