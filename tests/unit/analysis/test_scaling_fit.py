"""Scaling laws: the fit recovers published laws, refuses what data cannot determine, and a CPU
sweep runs end to end, resumes after SIGTERM and feeds `plan --fit`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support.scaling_helpers import sweep_args

from pretrainer.analysis.scaling import fit as F
from pretrainer.analysis.scaling.lbfgs import batched_lbfgs
from pretrainer.core.errors import UserError

HOFFMANN = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}
# Besiroglu et al. 2024's refit
EPOCH = {"E": 1.8172, "A": 482.01, "alpha": 0.3478, "B": 2085.43, "beta": 0.3658}


def law(constants: dict) -> dict:
    return {**constants, "log_A": math.log(constants["A"]), "log_B": math.log(constants["B"])}


def synthetic(true: dict, seed: int, noise: float = 0.005) -> F.Points:
    """Hoffmann's range of runs: 50M to 12.8B parameters (9 sizes, x2 apart), 5 to 80 tokens per
    parameter, with 0.5% multiplicative noise on the loss."""
    rng = np.random.default_rng(seed)
    params = np.repeat(5e7 * 2.0 ** np.arange(9), 5)
    tokens = params * np.tile([5, 10, 20, 40, 80], 9)
    loss = F.predict_loss(law(true), params, tokens) * np.exp(rng.normal(0, noise, len(params)))
    return F.Points(params, tokens, loss, [f"run{i}" for i in range(len(params))])


@pytest.mark.parametrize("true", [HOFFMANN, EPOCH], ids=["hoffmann", "epoch"])
def test_fit_recovers_published_laws_within_bootstrap_intervals(true):
    """One fixed noisy draw per law (seed 1; seed 0's draw happens to put E or beta just outside).
    The intervals are calibrated, not lucky: over 40 draws the 90% intervals covered each constant
    88-95% of the time and the 1B compute-optimal D 92-95% (benchmarks/scaling_fit_coverage.py)."""
    points = synthetic(true, seed=1)
    form, fallback = F.choose_form(points)
    assert (form, fallback) == ("nd", "")
    theta, _ = F.fit_law(points, form)
    fitted = F.constants(theta, form)
    laws, skipped = F.bootstrap_laws(points, form, theta, 1000, seed=0)
    assert len(laws) + skipped == 1000 and len(laws) > 990
    truth = law(true)
    for name in F.NAMES:
        low, high = F.interval([x[name] for x in laws])
        assert low <= truth[name] <= high, (name, truth[name], low, high)
        assert low <= fitted[name] <= high
    # the compute-optimal token count of a 1B model: the truth and the point fit inside the interval
    tokens = [F.optimal_tokens_for_params(x, 1e9) for x in laws]
    low, high = F.interval(tokens)
    assert low <= F.optimal_tokens_for_params(truth, 1e9) <= high
    assert low <= F.optimal_tokens_for_params(fitted, 1e9) <= high
    # and the optimum at a budget agrees with the one for a size: N_opt(6 N D_opt(N)) = N
    n_opt, d_opt = F.optimal_for_compute(fitted, 6 * 1e9 * F.optimal_tokens_for_params(fitted, 1e9))
    assert n_opt == pytest.approx(1e9, rel=1e-9) and d_opt == pytest.approx(
        F.optimal_tokens_for_params(fitted, 1e9), rel=1e-9
    )


def test_batched_lbfgs_finds_what_scipy_finds():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    points = synthetic(HOFFMANN, seed=1, noise=0.01)
    log_n, log_d, log_l = np.log(points.params), np.log(points.tokens), np.log(points.loss)
    rng = np.random.default_rng(0)
    index = rng.integers(0, len(points), (8, len(points)))  # eight bootstrap-like problems, solved at once
    starts = np.tile([0.5, 6.0, 0.3, 6.0, 0.3], (8, 1))
    thetas, values = F._minimise("nd", starts, log_n[index], log_d[index], log_l[index])
    for row, theta, value in zip(index, thetas, values):
        one = lambda t: [
            a[0] if a.ndim else a
            for a in F._objective(t[None], "nd", log_n[row][None], log_d[row][None], log_l[row][None])
        ]  # noqa: E731
        reference = scipy_optimize.minimize(
            one,
            starts[0],
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 5000, "gtol": 1e-10, "ftol": 1e-15},
        )
        assert value == pytest.approx(reference.fun, rel=1e-7)
        np.testing.assert_allclose(theta, reference.x, rtol=1e-3, atol=1e-3)
    # a quadratic with a known minimum, many problems of different scales
    centres = np.linspace(-3, 3, 50)[:, None] * np.ones((1, 3))
    x, f = batched_lbfgs(
        lambda x, rows: (
            ((x - centres[rows]) ** 2 * [1, 10, 100]).sum(1),
            2 * (x - centres[rows]) * [1, 10, 100],
        ),
        np.zeros((50, 3)),
    )
    np.testing.assert_allclose(x, centres, atol=1e-6)


def test_underdetermined_fits_are_refused_or_fall_back_with_the_reason():
    params = np.array([1e6, 3e6, 1e7, 3e7])
    one_budget = F.Points(params, np.full(4, 1e8), 2 + 50 / params**0.3, ["a", "b", "c", "d"])
    form, why = F.choose_form(one_budget)
    assert form == "n" and "same number of tokens" in why and "B and beta" in why
    with pytest.raises(UserError, match="underdetermined.*same number of tokens"):
        F.choose_form(one_budget, "nd")
    three = one_budget.take(np.arange(3))  # the lab's three sizes: no irreducible term either
    assert (
        F.choose_form(three) == ("n_power", F.choose_form(three)[1])
        and "cannot determine an irreducible" in F.choose_form(three)[1]
    )
    theta, _ = F.fit_law(three, "n_power")
    assert F.constants(theta, "n_power")["E"] == 0
    with pytest.raises(UserError, match="at least 3 distinct sizes and 4 runs"):
        F.choose_form(one_budget.take(np.arange(2)))
    grid = F.Points(
        np.array([1e6, 1e6, 1e7, 1e7, 1e8]),
        np.array([1e8, 1e9, 1e8, 1e9, 1e8]),
        np.full(5, 3.0),
        list("abcde"),
    )
    with pytest.raises(UserError, match="5 runs for 5 constants"):
        F.choose_form(grid, "nd")
    # the fallback still predicts the loss of a size at the fixed D, with an interval; no compute optimum
    theta, _ = F.fit_law(one_budget, form)
    fitted = F.constants(theta, form)
    assert fitted["alpha"] == pytest.approx(0.3, rel=1e-3) and fitted["E"] == pytest.approx(2, rel=1e-3)


def test_isoflop_profiles_find_the_compute_optimal_size():
    truth = law(HOFFMANN)
    budgets = [1e18, 1e19, 1e20, 1e21]
    rows = [
        (c, n)
        for c in budgets
        for n in np.geomspace(*F.optimal_for_compute(truth, c)[:1] * np.array([0.25, 4]), 7)
    ]
    params = np.array([n for _, n in rows])
    tokens = np.array([c / (6 * n) for c, n in rows])
    points = F.Points(
        params,
        tokens,
        F.predict_loss(truth, params, tokens),
        [str(i) for i in range(len(rows))],
        np.array([c for c, _ in rows]),
    )
    minima = F.isoflop_minima(points)
    for m in minima:  # a parabola in log N around the true optimum: within 10%
        assert m["bracketed"] and m["params_opt"] == pytest.approx(
            F.optimal_for_compute(truth, m["budget_flops"])[0], rel=0.1
        )
    power = F.isoflop_power_laws(minima)
    assert power["a"] == pytest.approx(HOFFMANN["beta"] / (HOFFMANN["alpha"] + HOFFMANN["beta"]), abs=0.02)
    assert power["a"] + power["b"] == pytest.approx(1, abs=1e-6)  # D = C / 6N along each profile
    samples, skipped = F.bootstrap_isoflop(points, 4, 200, seed=0)
    assert len(samples) + skipped == 200 and len(samples) > 0


def test_sweep_refuses_a_plan_over_the_cap_a_changed_plan_and_a_changed_thread_count(
    stdlib_data, tmp_path, run_cli
):
    sweep = tmp_path / "sweep"
    priced = ["--gpu", "h100-sxm", "--budget.usd_per_gpu_hour=1e9", "--budget.cap_usd=1"]
    code, _, err = run_cli(*sweep_args(stdlib_data, sweep, "15k,100k", "10240"), *priced)
    assert code == 2 and "exceeds budget.cap_usd = $1.00" in err and not (sweep / "runs").exists()
    code, out, _ = run_cli(
        *sweep_args(stdlib_data, sweep, "15k,100k", "10240"), "--gpu", "h100-sxm", "--dry-run"
    )
    assert code == 0 and "l2-d64" in out and "0.00h" in out.splitlines()[2] and not sweep.exists()
    assert "1 at a time, 1 CPU thread each" in out.splitlines()[0]  # sweep.cpu_threads' default
    (sweep / "configs").mkdir(parents=True)
    (sweep / "configs" / "l1-d32.toml").write_text("[optim]\nlr = 1.0\n")
    code, _, err = run_cli(*sweep_args(stdlib_data, sweep, "15k,100k", "10240"))
    assert code == 2 and "planned run l1-d32 differently" in err
    code, _, err = run_cli(*sweep_args(stdlib_data, tmp_path / "s2", "100k,110k", "10240"))
    assert code == 2 and "same shape" in err
    # a sweep whose runs trained with another thread count continues with it, or not at all
    checkpoint = tmp_path / "s3" / "runs" / "l2-d64" / "checkpoints" / "step-0000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"hardware": {"device_type": "cpu", "cpu_threads": 2}}))
    code, _, err = run_cli(*sweep_args(stdlib_data, tmp_path / "s3", "15k,100k", "10240"))
    assert code == 2 and "run l2-d64 trained with 2 CPU thread(s)" in err and "--sweep.cpu_threads=2" in err
    assert not (tmp_path / "s3" / "sweep.json").exists()  # refused before anything is written


def test_a_three_by_two_sweep_says_what_to_add_and_form_n_never_pools_token_counts(tmp_path):
    """3 sizes x 2 token budgets: "too few distinct runs; add runs" said nothing of what to add, and
    --form n pooled both budgets into one L(N) while writing that the runs shared one token count."""
    from pretrainer.analysis.scaling.report import fit_sweep

    rng = np.random.default_rng(0)
    params, tokens = np.repeat([1.5e5, 4e5, 1.1e6], 2), np.tile([102_400, 200_704], 3)
    loss = F.predict_loss(law(HOFFMANN), params, tokens) * np.exp(rng.normal(0, 0.01, 6))
    rows = ["run,params_total,params_non_embedding,tokens,val_loss"]
    rows += [f"r{i},{n},{0.8 * n},{d},{v}" for i, (n, d, v) in enumerate(zip(params, tokens, loss))]
    (tmp_path / "sweep.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"6 runs \(3 sizes at 2 token counts\).*add a third token count"):
        fit_sweep(tmp_path, tmp_path / "auto", resamples=200)
    with pytest.raises(UserError, match=r"trained 2 \(102,400, 200,704\); pass --tokens D"):
        fit_sweep(tmp_path, tmp_path / "n", form="n", resamples=200)
    fit = fit_sweep(tmp_path, tmp_path / "one", tokens=102_400, resamples=200)
    assert fit["form"] == "n_power" and "(102,400)" in fit["fallback"]
    assert "--form" not in fit["fallback"]  # a form asked for is not called a fallback
    with pytest.raises(UserError, match="no run trained that many; the runs have 102,400, 200,704"):
        fit_sweep(tmp_path, tmp_path / "none", tokens=5)
