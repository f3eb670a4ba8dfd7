"""Scaling-law fits with bootstrap intervals, and the compute-optimal predictions they imply.

The parametric law (Hoffmann et al. 2022, "approach 3"):

    L(N, D) = E + A / N^alpha + B / D^beta

fitted as they did: on log-loss, with the prediction written as a log-sum-exp of the three terms
(log L = LSE(a - alpha log N, b - beta log D, e), A = e^a, B = e^b, E = e^e), a Huber loss (delta
1e-3) on the residuals, and L-BFGS from a grid of initialisations (theirs: alpha, beta in {0, 0.5,
..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}). The grid's 4,500 starts are scored in
one vectorised pass and L-BFGS runs from the best START_POINTS of them; each bootstrap refit starts
from the point fit and the resample's best grid starts.

Data that cannot determine the law is refused, or fitted with the form it supports, and the
reason is kept: one token budget -> L(N) = E + A / N^alpha at that D; one size -> L(D) = E + B /
D^beta at that N; too few points (at least one more point than the form has constants) or too few
distinct sizes / token budgets -> an error saying which runs to add.

Compute-optimal allocation uses C = 6 N D (Hoffmann's convention, N as the fit counts it):
minimising L at fixed C gives N_opt = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta)),
and for a given N the compute-optimal D = (beta B N^alpha / (alpha A))^(1/beta).

IsoFLOP analysis ("approach 2"): for each compute budget, a parabola of loss against log N; its
minimum is N_opt(C), and D_opt(C) is read off the budget's own D-against-N curve (the sweep chose D
= C / FLOPs-per-token(N)); then log N_opt and log D_opt are fitted linearly in log C.

Intervals: bootstrap over runs (resampling with replacement; within each budget for IsoFLOP
fits), every constant and prediction recomputed per resample, the central LEVEL interval of the
resamples' values.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from pretrainer.analysis.scaling.lbfgs import batched_lbfgs
from pretrainer.core.errors import UserError

HUBER_DELTA = 1e-3
LEVEL = 0.90  # central interval of the bootstrap distribution
RESAMPLES = 1000
MAX_EXPONENT = 3.0  # an exponent beyond this (or <= 0) says the runs showed no power law in that variable
START_POINTS = 32  # L-BFGS starts taken from the initialisation grid (its best-scoring points)
BOOTSTRAP_STARTS = 4  # grid starts per bootstrap refit, beside the point fit
# a law as stored: the prefactors in logs (they overflow otherwise)
NAMES = ("E", "log_A", "alpha", "log_B", "beta")
GRID = {
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
# the free (log-space) constants of each form, in theta order
FORMS = {
    "nd": ("e", "a", "alpha", "b", "beta"),
    "n": ("e", "a", "alpha"),
    "d": ("e", "b", "beta"),
    "n_power": ("a", "alpha"),
}
FORM_TEXT = {
    "nd": "L(N, D) = E + A/N^alpha + B/D^beta",
    "n": "L(N) = E + A/N^alpha (D fixed)",
    "d": "L(D) = E + B/D^beta (N fixed)",
    "n_power": "L(N) = A/N^alpha (D fixed, no irreducible term)",
}
FIXED_D_FORMS = ("n", "n_power")


@dataclass
class Points:
    """Observed final losses: one per run."""

    params: np.ndarray  # N
    tokens: np.ndarray  # D
    loss: np.ndarray
    runs: list[str] = field(default_factory=list)
    budgets: np.ndarray | None = None  # IsoFLOP: the compute budget each run belongs to
    flops: np.ndarray | None = None

    def take(self, index: np.ndarray) -> "Points":
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        return Points(
            self.params[index],
            self.tokens[index],
            self.loss[index],
            [self.runs[i] for i in index] if self.runs else [],
            pick(self.budgets),
            pick(self.flops),
        )

    def __len__(self) -> int:
        return len(self.loss)


def choose_form(points: Points, wanted: str = "auto") -> tuple[str, str]:
    """-> (the form the data supports, why a simpler one than L(N, D) was taken: "" when not).
    Raises a UserError naming the runs to add when even the simplest form is underdetermined."""
    sizes, budgets, n = len(np.unique(points.params)), len(np.unique(points.tokens)), len(points)
    if wanted not in ("auto", "nd", "n", "d"):
        raise UserError(f"fit: --form must be auto, nd, n or d, got '{wanted}'")
    if wanted in ("auto", "nd") and sizes >= 2 and budgets >= 2 and n > 5:
        return "nd", ""
    # D varies: a fixed-D form would be wrong, the full one is short
    if wanted == "auto" and sizes >= 2 and budgets >= 2:
        raise UserError(
            f"fit: {n} runs for the 5 constants of {FORM_TEXT['nd']}: add runs (at least 6, several sizes at "
            f"several token counts), or fit the runs of one token count alone (a CSV with those rows)"
        )
    why = []
    if budgets < 2:
        why.append(
            f"every run trained the same number of tokens ({points.tokens[0]:,.0f}), so B and beta (the "
            f"D-term) "
            "are undetermined"
        )
    if sizes < 2:
        why.append(
            f"every run has the same size ({points.params[0]:,.0f} parameters), so A and alpha are "
            f"undetermined"
        )
    if sizes >= 2 and budgets >= 2 and n <= 5:
        why.append(f"{n} runs for 5 constants")
    counts = ", ".join(f"{t:,.0f}" for t in np.unique(points.tokens))
    if wanted == "n" and budgets > 1:  # pooled, L(N) would mix token counts and call it one
        raise UserError(
            f"fit: --form n fits L(N) at one token count, and these runs trained {budgets} ({counts}); pass "
            f"--tokens D to fit the runs of one of them, or --form nd for the full law L(N, D)"
        )
    if wanted == "d" and sizes > 1:
        raise UserError(
            f"fit: --form d fits L(D) at one size, and these runs have {sizes}; fit a CSV of one size's "
            f"rows, or --form nd for the full law L(N, D)"
        )
    if wanted == "nd":
        raise UserError(
            f"fit: {FORM_TEXT['nd']} is underdetermined: {'; '.join(why)}. Add runs at other token budgets "
            "(sweep.tokens = [D1, D2], tokens_per_param or isoflop) and sizes, at least 6 in all"
        )
    form = wanted if wanted != "auto" else ("n" if sizes >= budgets else "d")
    distinct = sizes if form == "n" else budgets
    if form == "n" and wanted == "auto" and (distinct < 3 or n < 4) and sizes >= 2 and n >= 3:
        # the lab's three sizes at one token count: E cannot be told apart as well; Kaplan et al.'s L(N)
        why.append(f"{n} runs cannot determine an irreducible loss E too")
        return "n_power", "; ".join(why)
    if distinct < 3 or n < 4:
        what = "sizes" if form == "n" else "token budgets"
        raise UserError(
            f"fit: {FORM_TEXT[form]} needs at least 3 distinct {what} and 4 runs (3 constants and one to "
            f"spare); the sweep has {distinct} distinct {what} in {n} runs. Add runs"
            + (f" ({'; '.join(why)})" if why else "")
        )
    return form, "; ".join(why) if wanted == "auto" else ""  # a form asked for is no fallback


def _design(points: Points) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.log(points.params), np.log(points.tokens), np.log(points.loss)


def _full_theta(theta: np.ndarray, form: str) -> list[np.ndarray]:
    """Columns (e, a, alpha, b, beta) of theta (problems, constants); an absent term's prefactor is
    -inf (a term of zero)."""
    columns = dict(zip(FORMS[form], (theta[:, i : i + 1] for i in range(theta.shape[1]))))
    absent = {"e": -np.inf, "a": -np.inf, "alpha": 0.0, "b": -np.inf, "beta": 0.0}
    return [columns.get(k, np.full((len(theta), 1), absent[k])) for k in FORMS["nd"]]


def _objective(theta: np.ndarray, form: str, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray):
    """Per problem (a row of theta, with its row of the data, or data shared by all rows): the sum of
    Huber(delta) residuals of log L, divided by delta (the same minimum; the optimiser's tolerances
    then see slopes of order one), and its gradient."""
    e, a, alpha, b, beta = _full_theta(theta, form)
    terms = np.stack(np.broadcast_arrays(a - alpha * log_n, b - beta * log_d, e))  # (3, problems, points)
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_l
    weights /= total  # d LSE / d term
    value = (
        np.where(
            np.abs(residual) <= HUBER_DELTA,
            0.5 * residual**2,
            HUBER_DELTA * (np.abs(residual) - 0.5 * HUBER_DELTA),
        ).sum(axis=1)
        / HUBER_DELTA
    )
    slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA
    grads = {
        "e": (slope * weights[2]).sum(axis=1),
        "a": (slope * weights[0]).sum(axis=1),
        "alpha": -(slope * weights[0] * log_n).sum(axis=1),
        "b": (slope * weights[1]).sum(axis=1),
        "beta": -(slope * weights[1] * log_d).sum(axis=1),
    }
    return value, np.stack([grads[k] for k in FORMS[form]], axis=1)


def _minimise(form: str, starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray):
    """L-BFGS from each start (rows; the data has a row per start, or one row shared by all) -> (theta,
    objective) per row."""
    data = (log_n, log_d, log_l)
    return batched_lbfgs(
        lambda theta, rows: _objective(theta, form, *(c if len(c) == 1 else c[rows] for c in data)), starts
    )


def _grid_starts(form: str, points: Points, count: int) -> np.ndarray:
    """The `count` best points of the initialisation grid, scored in one pass."""
    grid = np.array(list(itertools.product(*(GRID[k] for k in FORMS[form]))))  # (starts, constants)
    log_n, log_d, log_l = _design(points)
    scores, _ = _objective(grid, form, log_n[None], log_d[None], log_l[None])
    return grid[np.argsort(scores, kind="stable")[:count]]


def constants(theta: np.ndarray, form: str) -> dict[str, float]:
    """Fitted log-space constants (one row) -> a law: E, log_A, alpha, log_B, beta, and A and B where they
    are finite (an absent term: A or B = 0; a degenerate fit can push one past a float's range: None)."""
    e, a, alpha, b, beta = (float(c[0, 0]) for c in _full_theta(np.asarray(theta, dtype=float)[None], form))
    law = {"E": math.exp(e), "log_A": a, "alpha": alpha, "log_B": b, "beta": beta}
    return with_prefactors(law)


def with_prefactors(law: dict[str, float]) -> dict[str, float]:
    exp = lambda x: math.exp(x) if x < 700 else None  # noqa: E731
    return {**law, "A": exp(law["log_A"]), "B": exp(law["log_B"])}


def fit_law(points: Points, form: str) -> tuple[np.ndarray, float]:
    """The point fit: L-BFGS from the best START_POINTS of the grid -> (theta, objective)."""
    log_n, log_d, log_l = _design(points)
    thetas, values = _minimise(
        form, _grid_starts(form, points, START_POINTS), log_n[None], log_d[None], log_l[None]
    )
    best = int(np.nanargmin(values))
    return thetas[best], float(values[best])


def predict_loss(law: dict[str, float], params, tokens):
    """E + A/N^alpha + B/D^beta, computed from the logs of A and B (works on arrays)."""
    log_n, log_d = np.log(np.asarray(params, dtype=float)), np.log(np.asarray(tokens, dtype=float))
    with np.errstate(over="ignore"):  # a degenerate resample's law may overflow: inf, left out of intervals
        return (
            law["E"]
            + np.exp(law["log_A"] - law["alpha"] * log_n)
            + np.exp(law["log_B"] - law["beta"] * log_d)
        )


# Hoffmann et al. 2022, approach 3 (eq. 10), N the total parameters: the published law, used when no fit.json
PUBLISHED_LAW = {"E": 1.69, "log_A": math.log(406.4), "alpha": 0.34, "log_B": math.log(410.7), "beta": 0.28}


def tokens_for_loss(law: dict[str, float], params: float, loss: float) -> float:
    """The D at which L(N, D) reaches `loss` for this N: D = (B / (loss - E - A/N^alpha))^(1/beta); nan
    when no D reaches it (loss at or below the law's floor for this N, E + A/N^alpha)."""
    gap = loss - law["E"] - math.exp(min(law["log_A"] - law["alpha"] * math.log(params), 700.0))
    if gap <= 0 or law["beta"] <= 0:
        return math.nan
    log_d = (law["log_B"] - math.log(gap)) / law["beta"]
    return math.exp(log_d) if log_d < 700 else math.nan  # beyond any float of tokens: unreachable


def _log(x: float) -> float:
    return math.log(x) if x > 0 else math.nan  # a law with a non-positive exponent has no optimum


def optimal_tokens_for_params(law: dict[str, float], params: float) -> float:
    """The D that minimises loss at the compute 6 N D spends, for this N: the optimum's condition
    alpha A / N^alpha = beta B / D^beta, i.e. D = (beta B N^alpha / (alpha A))^(1/beta)."""
    alpha, beta = law["alpha"], law["beta"]
    if not (alpha > 0 and beta > 0):  # no interior optimum
        return math.nan
    log_d = (_log(beta) + law["log_B"] + alpha * math.log(params) - _log(alpha) - law["log_A"]) / beta
    return math.exp(min(log_d, 700.0)) if math.isfinite(log_d) else math.nan


def optimal_for_compute(law: dict[str, float], compute: float) -> tuple[float, float]:
    """(N_opt, D_opt) minimising L(N, D) subject to 6 N D = compute: N_opt = G (C/6)^(beta/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta))."""
    alpha, beta = law["alpha"], law["beta"]
    if not (alpha > 0 and beta > 0):
        return math.nan, math.nan
    log_g = (_log(alpha) + law["log_A"] - _log(beta) - law["log_B"]) / (alpha + beta)
    log_n = log_g + beta / (alpha + beta) * math.log(compute / 6)
    if not math.isfinite(log_n):
        return math.nan, math.nan
    params = math.exp(min(log_n, 700.0))
    return params, compute / 6 / params


def interval(values, level: float = LEVEL) -> list[float]:
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return [math.nan, math.nan]
    tail = (1 - level) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def bootstrap_laws(
    points: Points, form: str, theta: np.ndarray, resamples: int, seed: int
) -> tuple[list[dict], int]:
    """Refit on `resamples` resamplings of the runs (with replacement), each from the point fit and the
    full data's best BOOTSTRAP_STARTS grid starts -> (the laws, how many resamples were left out
    because they cannot determine the form, e.g. a resample with one size)."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(points), (resamples, len(points)))
    params, tokens = points.params[index], points.tokens[index]
    sizes = np.array([len(np.unique(row)) for row in params])
    budgets = np.array([len(np.unique(row)) for row in tokens])
    distinct_runs = np.array([len(set(zip(n, d))) for n, d in zip(params, tokens)])
    # a resample may repeat runs; it still determines the law with as many distinct runs as constants
    usable = {
        "nd": (sizes >= 2) & (budgets >= 2) & (distinct_runs >= 5),
        "n": sizes >= 3,
        "d": budgets >= 3,
        "n_power": sizes >= 2,
    }[form]
    index = index[usable]
    starts = np.vstack([theta[None], _grid_starts(form, points, BOOTSTRAP_STARTS)])  # (S, constants)
    log_n, log_d, log_l = (np.repeat(column[index], len(starts), axis=0) for column in _design(points))
    thetas, values = _minimise(form, np.tile(starts, (len(index), 1)), log_n, log_d, log_l)
    values = np.where(np.isfinite(values), values, np.inf).reshape(len(index), len(starts))
    best = thetas.reshape(len(index), len(starts), -1)[np.arange(len(index)), values.argmin(axis=1)]
    return [constants(row, form) for row in best], int((~usable).sum())


# --- IsoFLOP profiles (Hoffmann's approach 2) ---


def isoflop_minima(points: Points) -> list[dict]:
    """Per compute budget: the parabola of loss against log N, its minimum N_opt and the D there."""
    out = []
    for budget in np.unique(points.budgets):
        rows = points.budgets == budget
        log_n, log_d, loss = np.log(points.params[rows]), np.log(points.tokens[rows]), points.loss[rows]
        entry = {"budget_flops": float(budget), "runs": int(rows.sum()), "sizes": int(len(np.unique(log_n)))}
        if entry["sizes"] < 3:
            out.append({**entry, "problem": f"{entry['sizes']} distinct sizes: a parabola needs 3"})
            continue
        curve = np.polyfit(log_n, loss, 2)
        if curve[0] <= 0:
            out.append(
                {
                    **entry,
                    "problem": "the losses do not curve upwards: no minimum (add smaller and larger sizes)",
                }
            )
            continue
        best_log_n = -curve[1] / (2 * curve[0])
        tokens_line = np.polyfit(log_n, log_d, 1)  # D = C / FLOPs-per-token(N): nearly a line in log-log
        inside = log_n.min() <= best_log_n <= log_n.max()
        out.append(
            {
                **entry,
                "params_opt": float(np.exp(best_log_n)),
                "tokens_opt": float(np.exp(np.polyval(tokens_line, best_log_n))),
                "loss_opt": float(np.polyval(curve, best_log_n)),
                "parabola": [float(c) for c in curve],
                "bracketed": bool(inside),
            }
        )
    return out


def isoflop_power_laws(minima: list[dict]) -> dict | None:
    """log N_opt = a log C + log k_N and log D_opt = b log C + log k_D over the budgets with a minimum."""
    usable = [m for m in minima if "params_opt" in m]
    if len(usable) < 2:
        return None
    log_c = np.log([m["budget_flops"] for m in usable])
    n_line = np.polyfit(log_c, np.log([m["params_opt"] for m in usable]), 1)
    d_line = np.polyfit(log_c, np.log([m["tokens_opt"] for m in usable]), 1)
    return {
        "a": float(n_line[0]),
        "log_k_n": float(n_line[1]),
        "b": float(d_line[0]),
        "log_k_d": float(d_line[1]),
        "budgets": len(usable),
    }


def isoflop_at(
    power: dict, compute: float | None = None, params: float | None = None
) -> tuple[float, float, float]:
    """(C, N_opt, D_opt) from the IsoFLOP power laws, for a budget or (inverting N_opt(C)) a size."""
    if compute is None:
        compute = math.exp((math.log(params) - power["log_k_n"]) / power["a"])
    log_c = math.log(compute)
    return (
        compute,
        math.exp(power["a"] * log_c + power["log_k_n"]),
        math.exp(power["b"] * log_c + power["log_k_d"]),
    )


def bootstrap_isoflop(points: Points, budgets: int, resamples: int, seed: int) -> tuple[list[dict], int]:
    """IsoFLOP power laws refitted on resamples of the runs within each budget -> (the power laws,
    resamples left out: one where fewer than the point fit's `budgets` budgets have a minimum would
    fit a different set of budgets)."""
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(points.budgets == budget) for budget in np.unique(points.budgets)]
    out, skipped = [], 0
    for _ in range(resamples):
        index = np.concatenate([rng.choice(group, len(group), replace=True) for group in groups])
        power = isoflop_power_laws(isoflop_minima(points.take(index)))
        if power is None or power["budgets"] != budgets:
            skipped += 1
            continue
        out.append(power)
    return out, skipped
