"""A spike event's figure for `pretrainer postmortem`: the loss and grad norm around it (the flagged
steps drawn where they fall between logged rows), and the flagged batch's tokens against the training
distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrainer.core.files import save_figure

WINDOW = 30  # steps shown either side of an event in its figure


def write_figure(event, records: list[dict], unigram: dict | None, path: Path) -> None:
    """`event`: a post-mortem Event (analysis/report/postmortem.py, which imports this module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = event.steps[0] - WINDOW, event.steps[-1] + WINDOW
    rows = [r for r in records if "loss" in r and lo <= r["step"] <= hi]
    fig, axes = plt.subplots(
        1, 2 if unigram else 1, figsize=(13 if unigram else 8, 4.5), dpi=110, squeeze=False
    )
    ax = axes[0][0]
    steps = list(range(len(rows)))  # file order: a rollback repeats step numbers
    ax.plot(steps, [r["loss"] for r in rows], "-", color="C0", label="loss")
    flagged = [i for i, r in enumerate(rows) if event.first <= records.index(r) <= event.last]
    if flagged:
        ax.axvspan(min(flagged) - 0.5, max(flagged) + 0.5, color="C3", alpha=0.15, label="flagged")
    ax.set_xticks(
        steps[:: max(1, len(steps) // 10)], [rows[i]["step"] for i in steps[:: max(1, len(steps) // 10)]]
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    twin = ax.twinx()
    twin.plot(steps, [r.get("grad_norm", np.nan) for r in rows], "-", color="C1", label="grad norm")
    twin.set_ylabel("grad norm")
    # the flagged steps themselves (between logging steps they are in no logged row): drawn where they
    # fall, so the spike is on the figure and inside both axes
    for n, spike in enumerate(event.spikes):
        x = step_position(spike["step"], [r["step"] for r in rows])
        label = "flagged step" if n == 0 else None
        ax.plot([x], [spike.get("spike_loss", np.nan)], "v", color="C3", markersize=8, label=label)
        twin.plot([x], [spike.get("spike_grad_norm", np.nan)], "x", color="C3", markersize=8)
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    ax.set_title(f"spike {event.index}: {event.classification}")
    if unigram:
        ax = axes[0][1]
        worst = max(event.spikes, key=lambda r: r.get("spike_loss", 0.0), default=None)
        train_hist = unigram["train_rank_histogram"]
        labels = [
            f"{a}-{b - 1}" if b - a > 1 else f"{a}"
            for a, b in zip(unigram["bucket_edges"][:-1], unigram["bucket_edges"][1:])
        ]
        x = np.arange(len(train_hist))
        ax.bar(x - 0.2, train_hist, 0.4, color="C0", label="training distribution")
        if worst and worst.get("rank_histogram"):
            ax.bar(
                x + 0.2,
                worst["rank_histogram"],
                0.4,
                color="C3",
                label=f"flagged batch (step {worst['step']})",
            )
        ax.set_xticks(x, labels, rotation=60, fontsize=7)
        ax.set_xlabel("token frequency rank (0 = most frequent)")
        ax.set_ylabel("fraction of tokens")
        ax.set_title("batch tokens vs the training distribution")
        ax.legend()
    save_figure(fig, path)


def step_position(step: int, logged: list[int]) -> float:
    """Where `step` falls on a figure whose x positions are the logged rows (file order): between the
    last row at or before it and the next one."""
    before = [i for i, s in enumerate(logged) if s <= step]
    if not before:
        return 0.0
    i = before[-1]
    if i + 1 < len(logged) and logged[i + 1] > logged[i]:
        return i + (step - logged[i]) / (logged[i + 1] - logged[i])
    return float(i)
