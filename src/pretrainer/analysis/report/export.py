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

from pretrainer.analysis.report.html import write_html
from pretrainer.analysis.report.plots import metric_series, number, record_kinds, write_plots
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.errors import UserError
from pretrainer.core.files import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    save_safetensors,
    sha256_file,
)
from pretrainer.core.ownership import FILE_MARKER_KEY, json_object
from pretrainer.core.secrets import redact

# each package by the distributions that install it (mlflow-skinny: the same module, the tests' install)
PACKAGES = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "tiktoken": ("tiktoken",),
    "safetensors": ("safetensors",),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "pretrainer": ("pretrainer",),
}


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name, distributions in PACKAGES.items():
        versions[name] = "not installed"
        for distribution in distributions:
            try:
                versions[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
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

    from safetensors.torch import save

    from pretrainer.artifacts.hf_format import DTYPES
    from pretrainer.config.keys import to_dict

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
        suite_scores = metric_series(records, "suite_score")[1]
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
