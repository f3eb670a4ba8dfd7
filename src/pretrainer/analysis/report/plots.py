"""The report's plots (`pretrainer export`): loss, norms, LR, evaluations, throughput, MFU and $, each
titled by what it shows, with the run's events marked; and the series they draw from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from pretrainer.analysis.report.html import EVENT_STYLES, events
from pretrainer.core.files import save_figure

# as older metrics.jsonl wrote them
NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return NON_FINITE.get(value) if isinstance(value, str) else None


def record_kinds(records: list[dict]) -> list[str]:
    """step (a training step on the final trajectory), eval (a validation pass), tasks (an in-loop task
    evaluation), rolled_back (a step or pass that a rollback later ran again) or event (spikes,
    injections, rollbacks, budget, ...)."""

    def kind(r: dict) -> str:
        return (
            "event"
            if "step" not in r
            else "step"
            if "loss" in r
            else "eval"
            if "val_loss" in r
            else "tasks"
            if "suite_score" in r
            else "event"
        )

    kinds = [kind(r) for r in records]
    last = {(r["step"], k): i for i, (r, k) in enumerate(zip(records, kinds)) if k != "event"}
    kinds = [
        k if k == "event" or last[(r["step"], k)] == i else "rolled_back"
        for i, (r, k) in enumerate(zip(records, kinds))
    ]
    for position, r in enumerate(records):  # a rollback abandons what ran past its target, re-run or not
        if r.get("rollback") and "to_step" in r:
            for i in range(position):
                if kinds[i] != "event" and records[i]["step"] > r["to_step"]:
                    kinds[i] = "rolled_back"
    return kinds


def metric_series(records: list[dict], name: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, value) of one metric along the final trajectory: steps a rollback recomputed appear once
    (the later run), so a rolled-back run is not drawn backwards."""
    kinds = record_kinds(records)
    points = sorted(
        (r[x], v)
        for r, kind in zip(records, kinds)
        if kind in ("step", "eval", "tasks") and x in r and (v := number(r.get(name))) is not None
    )
    return [p[0] for p in points], [p[1] for p in points]


def time_unit(duration_s: float) -> tuple[str, float]:
    """(name, seconds per unit) that shows a run of this length in readable numbers, not in
    thousandths of an hour: seconds up to 2 minutes, minutes up to 2 hours, then hours."""
    if duration_s <= 120:
        return "seconds", 1.0
    if duration_s <= 2 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def throughput_series(records: list[dict]) -> tuple[tuple[list[float], list[float]], str]:
    """(wall-clock time in the unit that fits the run, tokens/s) and the time axis's label."""
    seconds, tokens_per_s = metric_series(records, "tokens_per_s", x="elapsed_s")
    unit, unit_s = time_unit(max(seconds, default=0.0))
    return ([t / unit_s for t in seconds], tokens_per_s), f"wall-clock {unit}"


TITLES = {  # each plot's title says what it shows
    "loss-curve.png": "training and validation loss",
    "gradnorm-curve.png": "gradient norm (before clipping) and parameter norm",
    "lr.png": "learning rate schedule",
    "evals.png": "evaluations over training tokens",
    "throughput.png": "throughput",
    "mfu-cost.png": "MFU and $ spent over wall-clock time",
}


def write_plots(records: list[dict], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def figure(
        name: str,
        lines: list[tuple[str, tuple[list, list], str]],
        xlabel: str,
        ylabel: str,
        *,
        log_y: bool = False,
        from_zero: bool = False,
        marks: list[tuple[int, str, str]] = (),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        for label, (xs, ys), style in lines:
            if xs:
                ax.plot(xs, ys, style, label=label, linewidth=1.2, markersize=4)
        for kind in sorted(
            {kind for _, kind, _ in marks}
        ):  # spikes, drills, rollbacks, alerts: one legend each
            steps = [step for step, k, _ in marks if k == kind]
            colour, style = EVENT_STYLES.get(kind, ("grey", "--"))
            for i, step in enumerate(steps[:100]):
                ax.axvline(
                    step,
                    color=colour,
                    alpha=0.8,
                    linewidth=1.1,
                    linestyle=style,
                    label=kind if i == 0 else None,
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{TITLES[name]}: {title}")  # what the plot shows, then whose run
        if log_y:
            ax.set_yscale("log")
        if from_zero:  # throughput: small wobbles should look small; LR: warmup from 0 reads as such
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, name)

    def save(fig, name: str) -> None:
        save_figure(fig, out / name)
        written.append(name)

    figure(
        "loss-curve.png",
        [
            ("train loss", metric_series(records, "loss"), "-"),
            ("val loss", metric_series(records, "val_loss"), "o-"),
        ],
        "step",
        "loss (nats/token)",
        marks=events(records),
    )
    figure(
        "gradnorm-curve.png",
        [
            ("grad norm (before clipping)", metric_series(records, "grad_norm"), "-"),
            ("param norm", metric_series(records, "param_norm"), "-"),
        ],
        "step",
        "L2 norm",
        log_y=True,
    )
    figure(
        "lr.png",
        [("learning rate", metric_series(records, "lr"), "-")],
        "step",
        "learning rate",
        from_zero=True,
    )
    panels = [
        (name, label, metric_series(records, name, x="tokens"))
        for name, label in (
            ("val_loss", "val loss (nats/token)"),
            ("val_bpb", "val bits per byte"),
            ("suite_score", "suite score (mean centered accuracy)"),
        )
    ]
    # runs from before bits per byte, or without tasks, have fewer
    panels = [panel for panel in panels if panel[2][0]]
    if panels:
        fig, axes = plt.subplots(
            len(panels), 1, figsize=(8, max(3.2, 2.6 * len(panels))), dpi=110, sharex=True, squeeze=False
        )
        for ax, (_, label, (xs, ys)) in zip(axes[:, 0], panels):
            ax.plot(xs, ys, "o-", linewidth=1.2, markersize=4)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(f"{TITLES['evals.png']}: {title}")
        axes[-1, 0].set_xlabel("tokens")
        save(fig, "evals.png")
    throughput, time_label = throughput_series(records)
    figure("throughput.png", [("tokens/s", throughput, "-")], time_label, "tokens/s", from_zero=True)
    # MFU (a GPU with a known peak) and $ spent (a priced run), against wall-clock time
    panels = [
        (label, metric_series(records, name, x="elapsed_s"))
        for name, label in (("mfu", "MFU"), ("spent_usd", "$ spent"))
    ]
    panels = [panel for panel in panels if panel[1][0]]
    if panels:
        unit, unit_s = time_unit(max(max(xs) for _, (xs, _) in panels))
        fig, axes = plt.subplots(
            len(panels), 1, figsize=(8, max(3.2, 2.6 * len(panels))), dpi=110, sharex=True, squeeze=False
        )
        for ax, (label, (xs, ys)) in zip(axes[:, 0], panels):
            ax.plot([x / unit_s for x in xs], ys, "-", linewidth=1.2)
            ax.set_ylabel(label, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(f"{TITLES['mfu-cost.png']}: {title}")
        axes[-1, 0].set_xlabel(f"wall-clock {unit}")
        save(fig, "mfu-cost.png")
    return written
