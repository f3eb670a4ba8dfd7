"""`pretrainer postmortem RUN_DIR`: a written account of every loss spike, from the run directory alone.

Spikes are the `spike` records in metrics.jsonl (flagged on the device while training), grouped
into events when they are at most GAP steps apart; invalid-token rejections are events too. Each
event is classified by the first rule in RULES that holds, with the evidence for it.

Outcome: the pre-spike trend is a straight line fitted to the last TREND logged losses before the
event; the run has recovered at the first later step whose loss is within 1% of that line, or back
at the level it had before the event (the median of its last 3 logged losses: a curving loss falls
away from a straight line's reach, and still recovers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrainer.analysis.report.spike_figure import write_figure
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import from_dict, read_toml
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes
from pretrainer.optim.schedule import lr_at

RULES_ROWS = [  # (classification, rule): the first that holds
    (
        "data corruption",
        "token ids outside the vocabulary were seen, or one token's share of a flagged batch "
        "is at least halfway from this run's typical top-token share (the median over the logged steps "
        "before the event) to 100% (a constant / repeated-token batch); e.g. typical 40% -> 70%",
    ),
    (
        "learning rate too high",
        "the LR used at or up to 2 steps before the event is more than 1.5x the schedule's (optim.* in "
        "config.toml)",
    ),
    (
        "rare-token gradient",
        "a flagged batch is >= 5% rare tokens (the rarest 1% of the training vocabulary) "
        "or its mean unigram log-probability is >= 3 nats below the run's typical batch",
    ),
    (
        "Adam second-moment blow-up",
        "the update/parameter ratio at the event is >= 5x its median over the preceding steps while batch "
        "and LR look normal: a large step from a tiny second-moment estimate",
    ),
    ("unclassified", "none of the above"),
]
RULES = "| classification | rule (the first that holds) |\n| --- | --- |\n" + "".join(
    f"| {name} | {rule} |\n" for name, rule in RULES_ROWS
)

GAP = 3  # flagged steps at most this far apart are one event
TREND = 20  # logged losses before an event that define its trend


@dataclass
class Event:
    index: int
    first: int  # position (record index) of the first flagged record
    last: int
    steps: list[int] = field(default_factory=list)
    spikes: list[dict] = field(default_factory=list)
    invalid: list[dict] = field(default_factory=list)
    classification: str = ""
    rule: str = ""
    evidence: list[str] = field(default_factory=list)


def find_events(records: list[dict]) -> list[Event]:
    events: list[Event] = []
    for position, record in enumerate(records):
        if not (record.get("spike") or record.get("invalid_tokens")):
            continue
        current = events[-1] if events else None
        if current is None or record["step"] - current.steps[-1] > GAP or record["step"] < current.steps[-1]:
            current = Event(index=len(events) + 1, first=position, last=position)
            events.append(current)
        current.last = position
        current.steps.append(record["step"])
        (current.spikes if record.get("spike") else current.invalid).append(record)
    return events


def train_losses(records: list[dict]) -> list[tuple[int, int, float]]:
    """(record position, step, loss) of the logged training steps, in file order (rollbacks repeat steps)."""
    return [
        (i, r["step"], r["loss"]) for i, r in enumerate(records) if isinstance(r.get("loss"), (int, float))
    ]


def classify(event: Event, records: list[dict], cfg) -> None:
    logged = {r["step"]: r for r in records[: event.first] if "loss" in r}
    before = [logged[s] for s in sorted(logged)][-TREND:]
    typical_log_prob = (
        float(np.median([r["batch_log_prob"] for r in before if "batch_log_prob" in r])) if before else None
    )
    ratios = [r["update_to_param"] for r in before if "update_to_param" in r]
    event_records = [r for r in records[event.first : event.last + 1] if "loss" in r] or event.spikes
    if event.invalid:
        worst = max(r.get("max_token_id", -1) for r in event.invalid)
        event.classification, event.rule = "data corruption", "token ids outside the vocabulary"
        event.evidence.append(
            f"token ids up to {worst} >= model.vocab_size {cfg.model.vocab_size}: rejected before the "
            f"embedding"
        )
        return
    top = max((r.get("top_token_fraction", 0.0) for r in event.spikes), default=0.0)
    shares = [r["top_token_fraction"] for r in before if "top_token_fraction" in r]
    # code: a space token can be ~40% of every batch
    typical_top = float(np.median(shares)) if shares else 0.0
    top_threshold = typical_top + (1.0 - typical_top) / 2
    if top >= top_threshold:
        event.classification = "data corruption"
        event.rule = (
            f"one token's share of a flagged batch >= {top_threshold:.0%}, halfway from this run's typical "
            f"top-token share ({typical_top:.0%}, median of {len(shares)} steps before) to 100%"
        )
        event.evidence.append(
            f"the most common token is {top:.0%} of a flagged batch (a repeated-token batch); token ids were "
            f"valid (max {max(r.get('max_token_id', 0) for r in event.spikes)} < {cfg.model.vocab_size})"
        )
        return
    event.evidence.append(
        f"top-token share {top:.0%}, below the corruption threshold {top_threshold:.0%} "
        f"(this run's typical {typical_top:.0%})"
    )
    lr_rows = [  # the flagged steps' own records carry their LR; logged steps nearby too
        r
        for r in records[: event.last + 1]
        if "lr" in r
        and ("loss" in r or r.get("spike"))
        and event.steps[0] - 2 <= r["step"] <= event.steps[-1]
    ]
    ratios_lr = [(r["step"], r["lr"], lr_at(r["step"] - 1, cfg.optim, cfg.train.max_steps)) for r in lr_rows]
    high = [(s, used, planned) for s, used, planned in ratios_lr if planned > 0 and used > 1.5 * planned]
    if high:
        s, used, planned = high[0]
        event.classification, event.rule = "learning rate too high", "LR used > 1.5x the schedule's"
        event.evidence.append(
            f"step {s}: LR {used:.4g} against the schedule's {planned:.4g} ({used / planned:.0f}x): the LR "
            f"changed"
        )
        return
    event.evidence.append("LR as scheduled" if ratios_lr else "no LR logged around the event")
    rare = max((r.get("rare_fraction", 0.0) for r in event.spikes), default=0.0)
    log_prob = min((r.get("batch_log_prob", 0.0) for r in event.spikes), default=0.0)
    if rare >= 0.05 or (typical_log_prob is not None and log_prob <= typical_log_prob - 3):
        event.classification, event.rule = (
            "rare-token gradient",
            ">= 5% rare tokens or batch log-prob >= 3 nats below typical",
        )
        event.evidence.append(
            f"flagged batch: {rare:.0%} rare tokens (rarest 1% of the vocabulary), mean unigram log-prob "
            f"{log_prob:.2f} vs typical {typical_log_prob:.2f}"
            if typical_log_prob is not None
            else f"flagged batch: {rare:.0%} rare tokens"
        )
        return
    measured = [r["update_to_param"] for r in event_records if "update_to_param" in r]
    event_ratio = max(measured) if measured else None  # a flagged step between logging steps has none
    said_ratio = f"{event_ratio:.3g}" if event_ratio is not None else "not logged at the event"
    if ratios and event_ratio is not None and event_ratio >= 5 * float(np.median(ratios)):
        event.classification, event.rule = (
            "Adam second-moment blow-up",
            "update/param >= 5x its median with normal batch and LR",
        )
        event.evidence.append(
            f"update/param {event_ratio:.3g} vs median {np.median(ratios):.3g} before, batch and LR normal"
        )
        return
    event.classification, event.rule = "unclassified", "no rule matched"
    event.evidence.append(
        f"batch: {rare:.0%} rare tokens, log-prob {log_prob:.2f}; update/param {said_ratio}"
    )


def outcome(event: Event, records: list[dict]) -> str:
    losses = train_losses(records)
    before = [(s, loss) for i, s, loss in losses if i < event.first][-TREND:]
    after = [(s, loss) for i, s, loss in losses if i > event.last]
    if len(before) < 3:
        return "not enough logged steps before the event to define a trend"
    slope, intercept = np.polyfit([s for s, _ in before], [loss for _, loss in before], 1)
    level = float(np.median([loss for _, loss in before[-3:]]))
    for s, loss in after:
        if loss <= (slope * s + intercept) * 1.01 or loss <= level * 1.01:
            back_to = (
                "the pre-spike trend" if loss <= (slope * s + intercept) * 1.01 else "its pre-spike level"
            )
            return (
                f"recovered: loss back within 1% of {back_to} at step {s}, "
                f"{s - event.steps[-1]} steps after the last flagged step"
            )
    return f"did not recover within the run (last logged step {after[-1][0] if after else event.steps[-1]})"


# Which spike.action fits which kind of spike (see train/spikes.py).
ADVICE = {
    "learning rate too "
    "high": "pick `rollback`: the damaging update came a step before the loss showed it, so by the time "
    "a spike is flagged the damage is in the weights and `skip` cannot undo it",
    "rare-token gradient": "`skip` is enough: the damage is the flagged batch's own update, which skip "
    "drops; `rollback` "
    "also works but recomputes the steps since its checkpoint",
    "data corruption": "`skip` drops the bad batch's update (ids outside the vocabulary are dropped under "
    "skip and rollback); "
    "find and clean the data at the logged positions",
    "Adam second-moment blow-up": "pick `rollback` with spike.rollback_lr_factor < 1 for a few hundred steps "
    "(spike.rollback_lr_steps): the optimizer state itself is what went wrong",
    "unclassified": "`rollback` is the safe choice when the cause is unknown; `skip` when spikes are single "
    "bad batches",
}


def recovery_action(event: Event, records: list[dict], cfg) -> str:
    skipped = sum(1 for r in event.spikes if r.get("skipped"))
    rollbacks = [r for r in records if r.get("rollback") and event.steps[0] <= r["step"] <= event.steps[-1]]
    parts = [f"spike.action = {cfg.spike.action}"]
    if rollbacks:
        parts += [
            f"rolled back at step {r['step']} to step {r['to_step']}, skipping {r['skipped_sequences']} "
            f"sequences"
            for r in rollbacks
        ]
    if skipped:
        parts.append(f"{skipped} optimizer update(s) skipped on the device")
    if event.invalid:
        parts.append(
            "the invalid batch was "
            + ("dropped" if cfg.spike.action != "log" else "rejected and the run stopped")
        )
    if not rollbacks and not skipped and not event.invalid:
        parts.append("logged only; updates were applied")
    regimes = [
        r["step"]
        for r in records
        if r.get("spike_regime") and event.steps[0] <= r["step"] <= event.steps[-1] + 1
    ]
    if regimes:
        parts.append(
            f"at step {regimes[0]}, after {cfg.spike.max_consecutive} flagged steps in a row, the detector "
            f"took the new "
            f"level as normal and updates resumed"
        )
    return "; ".join(parts)


def detector_coverage(records: list[dict], cfg) -> str:
    """What "no spikes" means for this run: the detector flags nothing before spike.min_values steps."""
    last = max((r["step"] for r in records if "loss" in r), default=0)
    if last <= cfg.spike.min_values:
        return (
            f"No spike could be detected: the detector starts after spike.min_values = "
            f"{cfg.spike.min_values} steps "
            f"and this run has {last}. Only non-finite losses or gradients would have been flagged."
        )
    return (
        f"No spikes were detected (the detector was active from step {cfg.spike.min_values + 1} to step "
        f"{last})."
    )


def write_postmortem(run_dir: Path) -> tuple[Path, list[Event], str]:
    """`run_dir`: a run dir, or one of its checkpoint dirs (RUN_DIR/checkpoints/step-N).
    -> (the post-mortem's path, the spike events, a one-line summary)."""
    run_dir = Path(run_dir)
    if run_dir.parent.name == "checkpoints" and (run_dir.parent.parent / "metrics.jsonl").is_file():
        run_dir = run_dir.parent.parent
    records = read_metrics(run_dir / "metrics.jsonl")
    config_path = run_dir / "config.toml"
    if not records or not config_path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl or config.toml; is this a run directory?")
    cfg = from_dict(read_toml(config_path), str(config_path))
    unigram = (
        json.loads((run_dir / "unigram.json").read_text()) if (run_dir / "unigram.json").is_file() else None
    )
    events = find_events(records)
    injected = [r for r in records if r.get("spike_injected")]
    lines = [
        f"# Spike post-mortem: {run_dir.name}",
        "",
        f"Run dir `{run_dir}`; detector: window {cfg.spike.window}, active after {cfg.spike.min_values} "
        f"values, "
        f"mean + {cfg.spike.sigmas:g} sigma on loss and grad norm, non-finite at once; action "
        f"`{cfg.spike.action}`.",
        "",
    ]
    if injected:
        steps = [r["step"] for r in injected]
        lines += [
            f"**Drill:** `{injected[0]['inject_kind']}` injected at steps {steps[0]}-{steps[-1]} "
            f"({len(injected)} batches, data positions from {injected[0]['data_cursor']}).",
            "",
        ]
    coverage = detector_coverage(records, cfg)
    if not events:
        lines += [coverage, ""]
    for event in events:
        classify(event, records, cfg)
        figure = f"spike-{event.index}.png"
        write_figure(event, records, unigram, run_dir / figure)
        first = (event.spikes or event.invalid)[0]
        near = [r["step"] for r in injected if abs(r["step"] - event.steps[0]) <= 2]
        lines += [
            f"## Spike {event.index}: {event.classification}",
            "",
            f"- **When:** detected at step {event.steps[0]} ({first.get('time_utc', 'time not recorded')}, "
            f"{first.get('elapsed_s', 0.0):.1f}s into the run); flagged steps "
            f"{', '.join(map(str, event.steps))}.",
            f"- **Classification:** {event.classification} (rule: {event.rule}).",
            *[f"- **Evidence:** {e}" for e in event.evidence],
        ]
        if near:
            lines.append(
                f"- **Injected:** yes, the drill's batch range (steps "
                f"{injected[0]['step']}-{injected[-1]['step']})."
            )
        lines += [
            f"- **Recovery action:** {recovery_action(event, records, cfg)}.",
            f"- **Which action to pick:** {ADVICE.get(event.classification, ADVICE['unclassified'])}.",
            f"- **Outcome:** {outcome(event, records)}.",
            "",
            "| step | loss | grad norm | LR | update/param | rare tokens | batch log-prob | max id | top "
            "token |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lo, hi = event.steps[0] - 3, event.steps[-1] + 3
        for r in records:
            if "loss" in r and lo <= r["step"] <= hi:
                lines.append(
                    f"| {r['step']} | {r['loss']:.3f} | {r.get('grad_norm', float('nan')):.3f} | "
                    f"{r.get('lr', 0):.3g} | "
                    f"{r.get('update_to_param', float('nan')):.3g} | {r.get('rare_fraction', 0):.0%} | "
                    f"{r.get('batch_log_prob', float('nan')):.2f} | {r.get('max_token_id', '')} | "
                    f"{r.get('top_token_fraction', 0):.0%} |"
                )
        lines += ["", f"![spike {event.index}]({figure})", ""]
    lines += [
        "## Classification rules",
        "",
        RULES,
        "Outcome: a straight line fitted to the last 20 logged losses before the event is the pre-spike "
        "trend; the run "
        "has recovered at the first later step whose loss is within 1% of it.",
        "",
    ]
    path = run_dir / "spike-postmortem.md"
    atomic_write_bytes(path, "\n".join(lines).encode())
    return path, events, ", ".join(f"step {e.steps[0]}: {e.classification}" for e in events) or coverage
