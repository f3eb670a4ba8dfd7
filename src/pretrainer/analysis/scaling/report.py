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
from pretrainer.analysis.scaling.fit_page import fit_markdown, plot_fit
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes, atomic_write_json

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
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(
            f"{path}: not a CSV text file ({type(e).__name__}); give a sweep dir or its sweep.csv"
        ) from None
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
    tokens: float | None = None,
) -> dict:
    """Fit the sweep's CSV; write fit.json, fit.md and the plots into `out` (default: next to the CSV).
    tokens: fit only the runs that trained this many tokens."""
    points, csv_path = read_points(source, params)
    if tokens is not None:
        chosen = np.isclose(points.tokens, tokens, rtol=1e-9)
        if not chosen.any():
            counts = ", ".join(f"{t:,.0f}" for t in np.unique(points.tokens))
            raise UserError(f"fit: --tokens {tokens:,.0f}: no run trained that many; the runs have {counts}")
        points = points.take(np.flatnonzero(chosen))
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
        sizes, budgets = len(np.unique(points.params)), len(np.unique(points.tokens))
        more = (
            "a third token count (sweep.tokens = [D1, D2, D3]): 3 sizes x 3 token counts or more"
            if form == "nd"
            else "more sizes"
            if form.startswith("n")
            else "more token counts"
        )
        raise UserError(
            f"fit: only {len(laws)} of {resamples} resamples could determine {F.FORM_TEXT[form]}: "
            f"{len(points)} runs ({sizes} sizes at {budgets} token counts) leave its constants barely "
            f"determined; add "
            f"{more}" + (", or fit the runs of one token count alone with --tokens D" if budgets > 1 else "")
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
