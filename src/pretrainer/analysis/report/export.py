"""`pretrainer export RUN_DIR --out DIR`: the run's report, from the run directory alone.

DIR/
  manifest.json         seed; versions; config and its sha256; hardware; tokens; final train/val
                        loss; wall time; $ spent; the final weights' reload check
  metrics.csv           long format: step,kind,name,value (every number in metrics.jsonl; kind: step,
                        eval, event, or rolled_back for a step a rollback later recomputed;
                        non-finite values as nan/inf)
  loss-curve.png        train and validation loss vs step, spikes, drills, rollbacks and alerts marked
  gradnorm-curve.png    gradient norm and parameter norm vs step
  lr.png                learning rate vs step
  evals.png             validation loss, bits per byte and (with eval.tasks_every) the suite score vs tokens
  mfu-cost.png          MFU (a GPU with a known peak) and $ spent (a priced run) vs wall-clock time
  index.html            all of it on one self-contained page (report/html.py)
  probes.md             the prompt probes' greedy completions at each in-loop evaluation (eval.tasks_every)
  throughput.png        tokens/s vs wall-clock time (seconds, minutes or hours: whichever fits the run)
  final.safetensors     the newest checkpoint's weights
  mlflow-run-uri.txt    where the mlflow run is (tracking URI and run id)
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import io
import json
import platform
import shutil
from pathlib import Path

from pretrainer.analysis.report.html import EVENT_STYLES, events, write_html
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.errors import UserError
from pretrainer.core.files import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    save_figure,
    save_safetensors,
    sha256_file,
)
from pretrainer.core.ownership import FILE_MARKER_KEY
from pretrainer.core.secrets import redact

PACKAGES = ("torch", "numpy", "tiktoken", "safetensors", "mlflow", "pretrainer")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def weights_round_trip(path: Path, scratch: Path) -> dict:
    """Reload the weights and save them again: the bytes must be identical."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    save_safetensors(load_file(path), scratch, metadata=metadata)
    identical = scratch.read_bytes() == path.read_bytes()
    scratch.unlink()
    return {"file": path.name, "sha256": sha256_file(path), "reload_resave_byte_identical": identical}


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


def write_metrics_csv(records: list[dict], path: Path) -> int:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "kind", "name", "value"])
    rows = 0
    for record, kind in zip(records, record_kinds(records)):
        for name, value in record.items():
            if name != "step" and (x := number(value)) is not None:
                writer.writerow([record.get("step", ""), kind, name, repr(x)])
                rows += 1
    atomic_write_bytes(path, buffer.getvalue().encode())
    return rows


def _series(records: list[dict], name: str, x: str = "step") -> tuple[list[float], list[float]]:
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
    seconds, tokens_per_s = _series(records, "tokens_per_s", x="elapsed_s")
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
        [("train loss", _series(records, "loss"), "-"), ("val loss", _series(records, "val_loss"), "o-")],
        "step",
        "loss (nats/token)",
        marks=events(records),
    )
    figure(
        "gradnorm-curve.png",
        [
            ("grad norm (before clipping)", _series(records, "grad_norm"), "-"),
            ("param norm", _series(records, "param_norm"), "-"),
        ],
        "step",
        "L2 norm",
        log_y=True,
    )
    figure(
        "lr.png", [("learning rate", _series(records, "lr"), "-")], "step", "learning rate", from_zero=True
    )
    panels = [
        (name, label, _series(records, name, x="tokens"))
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
        (label, _series(records, name, x="elapsed_s"))
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


def write_probes_table(probes: list[dict], path: Path) -> None:
    """probes.md: for each prompt, its greedy completion at each in-loop evaluation (the newest run of
    a step, when a rollback ran it again)."""
    latest = {(r["step"], r["prompt"]): r for r in probes}
    # one table row per completion
    cell = lambda text: text.replace("|", "\\|").replace("\n", "\\n")
    lines = ["# Prompt probes", "", "Greedy completions during training (eval.tasks_every).", ""]
    for prompt in dict.fromkeys(r["prompt"] for r in probes):
        lines += [f"## `{cell(prompt)}`", "", "| step | tokens | completion |", "|---:|---:|---|"]
        lines += [
            f"| {r['step']} | {r['tokens']:,} | {cell(r['completion'])} |"
            for (step, p), r in sorted(latest.items())
            if p == prompt
        ]
        lines.append("")
    atomic_write_bytes(path, "\n".join(lines).encode())


def export_weights(run, out: Path, dtype: str) -> None:
    """One safetensors file of the run's newest weights, with the model config and the tokenizer's
    id in its metadata (`pretrainer export RUN --format safetensors`)."""
    import json

    from safetensors.torch import save

    from pretrainer.artifacts.hf_format import DTYPES
    from pretrainer.config.schema import to_dict

    tokenizer = run.tokenizer()
    metadata = {
        "format": "pt",
        "pretrainer_model_config": json.dumps(to_dict(run.cfg)["model"], sort_keys=True),
        "tokenizer": json.dumps({"name": tokenizer.name, "sha256": tokenizer.sha256}, sort_keys=True),
        FILE_MARKER_KEY: "safetensors",  # what `export --force` may replace (core/ownership.py)
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in run.load_weights().items()}
    atomic_write_bytes(out, save(weights, metadata=metadata), kind="safetensors")


def stage_lineage(state: dict) -> dict:
    """The runs this one started from (init.from), oldest first, each with its checkpoint, the sha256 of
    its weights and its tokens, and the tokens of the whole chain (pretrain -> mid-train -> SFT)."""
    chain, parent = [], state.get("parent")
    while parent:
        chain.insert(0, {k: v for k, v in parent.items() if k != "parent"})
        parent = parent.get("parent")
    stages = [
        *chain,
        {
            "run": "this run",
            "tokens": state["tokens"],
            "trained_tokens": state.get("trained_tokens", state["tokens"]),
        },
    ]
    return (
        {
            "lineage": chain,
            "tokens_all_stages": sum(stage.get("tokens") or 0 for stage in stages),
            "trained_tokens_all_stages": sum(stage.get("trained_tokens") or 0 for stage in stages),
        }
        if chain
        else {"lineage": []}
    )


KEPT_ACROSS_EXPORTS = ("serve_cost.json", "serve_cost.md")  # written into RUN/report by serve-cost


def json_object(path: Path) -> dict:
    """A JSON object file's content; {} for a missing or unreadable one."""
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def export_report(run, out: Path) -> dict:
    """`run`: a run dir, a checkpoint dir, or an already opened run (pretrainer.runs.OpenRun)."""
    from pretrainer.artifacts.runs import OpenRun, open_run

    run = run if isinstance(run, OpenRun) else open_run(run)
    run_dir, checkpoint, state = run.run_dir, run.checkpoint, run.state
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise UserError(f"{run_dir}/metrics.jsonl: no metrics; is this a run directory?")
    with atomic_directory(Path(out), kind="report") as tmp:
        for name in KEPT_ACROSS_EXPORTS:  # what other verbs wrote there (12 minutes of serve-cost) stays
            kept = Path(out) / name
            if kept.is_file() and not kept.is_symlink():
                shutil.copy2(kept, tmp / name)
        shutil.copyfile(checkpoint / "model.safetensors", tmp / "final.safetensors")
        weights_check = weights_round_trip(tmp / "final.safetensors", tmp / ".resave.safetensors")
        rows = write_metrics_csv(records, tmp / "metrics.csv")
        plots = write_plots(records, tmp, title=run_dir.name)
        probes = read_metrics(run_dir / "probes.jsonl") if (run_dir / "probes.jsonl").is_file() else []
        if probes:
            write_probes_table(probes, tmp / "probes.md")
        # the final trajectory's (a rollback's abandoned ones left out)
        suite_scores = _series(records, "suite_score")[1]
        train_losses = [r for r in records if "loss" in r]
        val_losses = [r for r in records if "val_loss" in r]
        # `pretrainer eval` of this checkpoint: measured at its step (the in-loop one may be older)
        evaluated = json_object(run_dir / f"eval-{state['step']:07d}.json")
        measured_after = []  # its row in the page's evaluations
        if evaluated.get("step") == state["step"] and "val_loss" in evaluated:
            val_losses.append(evaluated)
            columns = ("step", "tokens", "val_loss", "val_bpb", "suite_score")
            measured_after = [{k: evaluated[k] for k in columns if evaluated.get(k) is not None}]
            if evaluated.get("suite_score") is not None:
                suite_scores.append(evaluated["suite_score"])
        config_path = run_dir / "config.toml"
        mlflow_uri = None
        if (run_dir / "mlflow-run-id.txt").is_file():
            run_id = (run_dir / "mlflow-run-id.txt").read_text().strip()
            tracking = redact(  # a run saved before credentials were kept out of files
                state["config"].get("track", {}).get("mlflow_uri")
                or state["config"].get("mlflow", {}).get("uri")  # a run saved before track.mlflow_uri
                or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
            )
            mlflow_uri = {"tracking_uri": tracking, "run_id": run_id, "run_uri": f"runs:/{run_id}"}
            atomic_write_bytes(
                tmp / "mlflow-run-uri.txt",
                f"tracking_uri: {tracking}\nrun_id: {run_id}\nrun_uri: runs:/{run_id}\n"
                f"view: mlflow ui --backend-store-uri {tracking}\n".encode(),
            )
        manifest = {
            "run_dir": str(run_dir.resolve()),
            "checkpoint": checkpoint.name,
            "seed": state["config"]["train"]["seed"],
            "versions": package_versions(),
            "config": state["config"],
            "config_toml_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest()
            if config_path.is_file()
            else None,
            "config_sha256": state["config_sha256"],
            "dataset": state.get("dataset"),  # tokenizer and split sha256: which data trained the model
            "hardware": state.get("hardware", {}),
            "steps": state["step"],
            "tokens": state["tokens"],
            "trained_tokens": state.get(
                "trained_tokens", state["tokens"]
            ),  # the targets the loss counted (loss masks)
            "tokens_per_step": state["tokens_per_step"],
            # which optimizer, and its state's measured size on rank 0 (the whole state unless FSDP shards it)
            "optimizer": {
                **state.get("optimizer", {"name": state["config"]["optim"].get("name", "adamw")}),
                "state_bytes_rank0": state.get("optimizer_state_bytes_rank0"),
            },
            **stage_lineage(state),
            "final_train_loss": train_losses[-1]["loss"] if train_losses else None,
            "final_val_loss": val_losses[-1]["val_loss"] if val_losses else None,
            "final_val_bpb": val_losses[-1].get("val_bpb") if val_losses else None,
            "final_val_step": val_losses[-1].get("step") if val_losses else None,  # where it was measured
            "kept_from_other_verbs": sorted(p.name for p in tmp.iterdir() if p.name in KEPT_ACROSS_EXPORTS),
            "final_suite_score": suite_scores[-1] if suite_scores else None,
            "wall_time_s": state["elapsed_s"],
            "spent_usd": state.get("spent_usd"),
            "final_weights": weights_check,
            "metrics_csv_rows": rows,
            "plots": plots,
            "page": "index.html",
            "probes_table": "probes.md" if probes else None,
            "mlflow": mlflow_uri,
        }
        atomic_write_json(tmp / "manifest.json", manifest)
        write_html(tmp, run, manifest, records + measured_after, probes)
        if not weights_check["reload_resave_byte_identical"]:
            raise UserError(
                f"{checkpoint}/model.safetensors: reloading and re-saving changed the bytes; report not "
                f"written"
            )
    return manifest
