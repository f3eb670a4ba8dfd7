"""How often the fit's bootstrap intervals cover the true constants: synthetic sweeps drawn from a
known law (Hoffmann et al.'s or Epoch AI's refit) over Hoffmann's range of runs (9 sizes, 50M to
12.8B parameters, x 5 token ratios, 5 to 80 tokens per parameter), with multiplicative noise.

    python benchmarks/scaling_fit_coverage.py --seeds 40 --resamples 1000

A central 90% interval should cover each constant in about 90% of the draws; all five at once less
often (they are correlated). tests/test_scaling.py checks one fixed draw per law.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pretrainer.analysis.scaling import fit as F  # noqa: E402

LAWS = {
    "hoffmann": {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28},
    "epoch": {"E": 1.8172, "A": 482.01, "alpha": 0.3478, "B": 2085.43, "beta": 0.3658},
}


def draw(true: dict, seed: int, noise: float) -> F.Points:
    rng = np.random.default_rng(seed)
    params = np.repeat(5e7 * 2.0 ** np.arange(9), 5)
    tokens = params * np.tile([5, 10, 20, 40, 80], 9)
    law = {**true, "log_A": math.log(true["A"]), "log_B": math.log(true["B"])}
    loss = F.predict_loss(law, params, tokens) * np.exp(rng.normal(0, noise, len(params)))
    return F.Points(params, tokens, loss, [str(i) for i in range(len(params))])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--noise", type=float, default=0.005)
    args = parser.parse_args()
    for name, true in LAWS.items():
        law = {**true, "log_A": math.log(true["A"]), "log_B": math.log(true["B"])}
        covered = {k: 0 for k in (*F.NAMES, "D_opt(1B)")}
        all_five, started = 0, time.perf_counter()
        for seed in range(args.seeds):
            points = draw(true, seed, args.noise)
            theta, _ = F.fit_law(points, "nd")
            laws, _ = F.bootstrap_laws(points, "nd", theta, args.resamples, seed)
            hits = {
                k: F.interval([x[k] for x in laws])[0] <= law[k] <= F.interval([x[k] for x in laws])[1]
                for k in F.NAMES
            }
            low, high = F.interval([F.optimal_tokens_for_params(x, 1e9) for x in laws])
            hits["D_opt(1B)"] = low <= F.optimal_tokens_for_params(law, 1e9) <= high
            for k, hit in hits.items():
                covered[k] += hit
            all_five += all(hits[k] for k in F.NAMES)
        rates = ", ".join(f"{k} {v / args.seeds:.0%}" for k, v in covered.items())
        print(
            f"{name}: {args.seeds} draws, noise {args.noise:g}, {args.resamples} resamples: coverage "
            f"{rates}; "
            f"all five constants {all_five / args.seeds:.0%} ({time.perf_counter() - started:.0f}s)"
        )


if __name__ == "__main__":
    main()
