"""L-BFGS over many independent problems at once, vectorised with numpy.

A bootstrap refits the same small law (3-5 constants, tens of points) on a thousand resamples, and
the point fit starts from many grid points: scipy's L-BFGS-B takes ~30 ms per problem in Python
overhead, this takes ~3 ms per thousand problems per iteration. Each problem keeps its own
curvature pairs, step and convergence test, so the results are those of running them one by one
(tests/test_scaling.py checks them against scipy.optimize.minimize's L-BFGS-B).

    x, f = batched_lbfgs(fun, x0)     # fun(x: (r, k), rows: (r,)) -> (f: (r,), gradient: (r, k))

`fun` is asked only about the problems still running (`rows` says which), so converged ones cost
nothing.
"""

from __future__ import annotations

import numpy as np


def batched_lbfgs(
    fun,
    x0: np.ndarray,
    *,
    memory: int = 10,
    max_iter: int = 1000,
    gtol: float = 1e-9,
    ftol: float = 1e-13,
    c1: float = 1e-4,
    max_halvings: int = 40,
) -> tuple[np.ndarray, np.ndarray]:
    """Minimise R problems from their starts x0 (R, k) -> (x, f). A problem stops when its largest
    gradient component is below gtol, when a step lowers f by less than ftol x max(|f|, 1), or when
    the backtracking (Armijo) line search finds no decrease."""
    x = np.array(x0, dtype=float)
    problems, _ = x.shape
    f, g = fun(x, np.arange(problems))
    pairs_s, pairs_y = np.zeros((memory, *x.shape)), np.zeros((memory, *x.shape))
    rho = np.zeros((memory, problems))  # 0 for a pair that was not kept: it then has no effect
    gamma = np.ones(problems)  # the initial inverse-Hessian scale, s.y / y.y of the newest pair
    active = np.isfinite(f) & (np.abs(g).max(axis=1) > gtol)
    for iteration in range(max_iter):
        rows = np.flatnonzero(active)
        if not len(rows):
            break
        xa, fa, ga = x[rows], f[rows], g[rows]
        # the two-loop recursion: direction = -H g, newest pair first
        q, alphas = ga.copy(), np.zeros((memory, len(rows)))
        newest_first = [(iteration - 1 - j) % memory for j in range(min(iteration, memory))]
        for i in newest_first:
            alphas[i] = rho[i, rows] * (pairs_s[i, rows] * q).sum(axis=1)
            q -= alphas[i][:, None] * pairs_y[i, rows]
        r = gamma[rows, None] * q
        for i in reversed(newest_first):
            r += pairs_s[i, rows] * (alphas[i] - rho[i, rows] * (pairs_y[i, rows] * r).sum(axis=1))[:, None]
        direction = -r
        slope = (ga * direction).sum(axis=1)
        uphill = ~(slope < 0)  # fall back to steepest descent
        direction[uphill], slope[uphill] = -ga[uphill], -(ga[uphill] ** 2).sum(axis=1)
        step = (
            np.ones(len(rows))
            if iteration
            else np.minimum(1.0, 1.0 / np.maximum(np.abs(ga).sum(axis=1), 1e-12))
        )
        searching = np.ones(len(rows), dtype=bool)
        x_new, f_new, g_new = xa.copy(), fa.copy(), ga.copy()
        for _ in range(max_halvings):
            ask = np.flatnonzero(searching)
            trial = xa[ask] + step[ask, None] * direction[ask]
            f_trial, g_trial = fun(trial, rows[ask])
            accepted = np.isfinite(f_trial) & (f_trial <= fa[ask] + c1 * step[ask] * slope[ask])
            took = ask[accepted]
            x_new[took], f_new[took], g_new[took] = trial[accepted], f_trial[accepted], g_trial[accepted]
            searching[took] = False
            if not searching.any():
                break
            step[searching] /= 2
        stuck = searching  # no decrease along the direction: as converged as it gets
        s, y = x_new - xa, g_new - ga
        sy = (s * y).sum(axis=1)
        keep = ~stuck & (sy > 1e-16)  # the curvature condition, else the pair is dropped
        slot = iteration % memory
        pairs_s[slot, rows], pairs_y[slot, rows] = (
            np.where(keep[:, None], s, 0.0),
            np.where(keep[:, None], y, 0.0),
        )
        rho[slot, rows] = np.where(keep, 1.0 / np.where(keep, sy, 1.0), 0.0)
        gamma[rows] = np.where(keep, sy / np.maximum((y * y).sum(axis=1), 1e-300), gamma[rows])
        decrease = fa - f_new
        x[rows], f[rows], g[rows] = x_new, f_new, g_new
        active[rows] = (
            ~stuck & (np.abs(g_new).max(axis=1) > gtol) & (decrease > ftol * np.maximum(np.abs(f_new), 1.0))
        )
    return x, f
