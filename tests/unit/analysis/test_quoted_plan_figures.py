"""The plan figures the docs and configs quote (the X1 lab's bill, ours, the target-loss horizon, the
6N cross-check, the scaling sweep's dry run) are today's plan: plan is pure arithmetic, so each quote is
computed again here and looked up where it is written; a changed planner fails with the new figure."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"
LAB = ["--gpu", "a100-80gb", "--mfu", "0.48", "--usd-per-gpu-hour", "1.10", "--tokens", "43e9"]


def test_every_quoted_plan_figure_is_today_s(run_cli):
    def plan(config: str, *args: str) -> dict:
        code, out, err = run_cli("plan", CONFIGS / config, *args, "--json")
        assert code == 0, err
        return json.loads(out)

    lab, ours = plan("x1-lab00.toml"), plan("x1-50m.toml")
    target = plan("x1-lab00.toml", "--target-loss", "3.3", "--compare")
    six_n, full = plan("x1-50m.toml", *LAB, "--flops", "6n"), plan("x1-50m.toml", *LAB)
    code, sweep, err = run_cli("sweep", CONFIGS / "x1-scaling.toml", "--dry-run")
    assert code == 0, err
    sweep_hours = [float(h) for h in re.findall(r" ([\d.]+)h ", sweep)]
    sweep_usd = re.search(r"FLOPs, \$([\d.]+) at", sweep).group(1)
    cheapest = next(row["instance"] for row in target["compare"] if row.get("cheapest"))

    def money(value: float) -> str:
        return f"${value:.2f}"

    quotes = {
        "docs/planning.md": [
            f"gives a {money(lab['bill']['total_usd'])} total against the $35 cap, NO-GO",
            f"{lab['wall_hours']:.2f} h; NO-GO at {money(lab['bill']['total_usd'])}",
            f"{ours['steps']:,} steps (~5B tokens)",
            f"{money(ours['bill']['total_usd'])} in all; GO",
            f"# {int(target['token_budget']):,} tokens; the RTX 4090 row is cheapest",
            f"{sum(sweep_hours):.1f} h and ${sweep_usd} at 2B tokens each",
        ],
        "configs/x1-lab00.toml": [
            f"{lab['wall_hours']:.2f} h: 6N",
            f"{money(lab['cost_usd'])} compute, {money(lab['bill']['total_usd'])} in all: NO-GO",
        ],
        "configs/x1-50m.toml": [
            f"steps     {ours['steps']:,} ({ours['tokens_trained']:,} tokens",
            f"~5B; {ours['wall_hours']:.2f} h)",
            f"NO-GO at {money(lab['bill']['total_usd'])}",
            f"{money(ours['bill']['total_usd'])} in all",
        ],
        "configs/x1-scaling.toml": [
            "5M {:.2f} h, 25M {:.2f} h, 100M {:.2f} h".format(*sweep_hours),
            f"${sweep_usd} for the three",
        ],
        "docs/training.md": [
            f"gives {six_n['wall_hours']:.2f} h, {money(six_n['cost_usd'])}",
            f"take {full['wall_hours']:.1f} h",
        ],
        "docs/benchmarks.md": [
            f"| {row['flops_per_token']:,} | {row['wall_hours']:.2f} h | {money(row['cost_usd'])} |"
            for row in (six_n, full)
        ],
    }
    assert "4090" in cheapest, cheapest
    for path, texts in quotes.items():
        text = (ROOT / path).read_text()
        missing = [quote for quote in texts if quote not in text]
        assert not missing, f"{path} does not quote today's plan: {missing}"
