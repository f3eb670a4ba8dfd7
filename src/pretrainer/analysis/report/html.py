"""The report as one page: REPORT/index.html, self-contained (the plots inline, no script or font from
the network), to open in a browser or send to someone.

    write_html(report_dir, run, manifest, records)   # after export wrote the plots and manifest.json

It shows the run's figures and how it ended (exit.json: the reason, and the command that resumes it),
the plots (loss with spikes, drills, rollbacks and alerts marked; evaluations; LR; norms; throughput;
MFU and $ spent), the evaluations, the events, and what `plan` makes of the config against what the
run did.
"""

from __future__ import annotations

import base64
import html
import json
import shlex
from pathlib import Path

from pretrainer.core.files import atomic_write_bytes

# the plots export writes, in the page's order, with what each shows
PLOTS = {
    "loss-curve.png": "Training and validation loss; dashed lines mark spikes, drills, rollbacks and alerts",
    "evals.png": "Validation loss, bits per byte and task score against tokens",
    "lr.png": "Learning rate",
    "gradnorm-curve.png": "Gradient norm (before clipping) and parameter norm",
    "throughput.png": "Training throughput",
    "mfu-cost.png": "MFU and dollars spent",
}


# what an event record is, by the key that makes it one (train/spikes.py, alerts.py, stopping.py)
EVENT_KEYS = {
    "spike_injected": "drill",
    "spike": "spike",
    "rollback": "rollback",
    "invalid_tokens": "bad tokens",
    "alert": "alert",
    "budget_problem": "budget",
}
# each kind its own colour and line style (spikes and alerts were both a pale red), with a legend
EVENT_STYLES = {
    "drill": ("tab:purple", "-."),
    "spike": ("tab:red", "--"),
    "rollback": ("tab:orange", "-"),
    "alert": ("tab:blue", ":"),
}
NOT_EVENTS = {"finished"}  # the end-of-run alert: how the run ended, said in the summary, not an event


def events(records: list[dict]) -> list[tuple[int, str, str]]:
    """(step, kind, what it says) of each event record: spikes, drills, rollbacks, alerts."""
    out = []
    for r in records:
        kind = next((name for key, name in EVENT_KEYS.items() if r.get(key)), None)
        if kind is None or "step" not in r or (kind == "alert" and r.get("alert") in NOT_EVENTS):
            continue
        detail = r.get("message") or r.get("alert") or r.get("inject_kind") or ""
        if kind == "spike":  # what was flagged, and what was done
            loss, norm = r.get("spike_loss", float("nan")), r.get("spike_grad_norm", float("nan"))
            done = "update skipped" if r.get("skipped") else "logged only"
            detail = f"loss {loss:.3f}, grad norm {norm:.3f}, {done}"
        out.append((int(r["step"]), kind, str(detail)))
    return out


def plan_against_actual(run) -> list[tuple[str, str, str]]:
    """(figure, planned, actual): what `pretrainer plan` makes of the run's config, and what it did."""
    from pretrainer.analysis.plan import make_plan
    from pretrainer.core.errors import UserError

    state = run.state
    try:
        plan = make_plan(run.cfg)
    except UserError:
        plan = {}
    rows = [
        ("steps", f"{plan.get('steps', 0):,}", f"{state['step']:,}"),
        ("tokens", f"{plan.get('steps', 0) * plan.get('tokens_per_step', 0):,}", f"{state['tokens']:,}"),
        ("parameters", f"{plan.get('params_total', 0):,}", ""),
    ]
    hours = state["elapsed_s"] / 3600
    planned = f"{plan['wall_hours']:.2f}" if "wall_hours" in plan else "(no GPU peak to plan from)"
    rows.append(("wall time (h)", planned, f"{hours:.3f}"))
    if "cost_usd" in plan or state.get("spent_usd"):
        planned = f"{plan['cost_usd']:.2f}" if "cost_usd" in plan else "(no price)"
        rows.append(("cost ($)", planned, f"{state.get('spent_usd') or 0:.2f}"))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = lambda row, tag: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)
    body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows)
    return f"<table><thead><tr>{cells(header, 'th')}</tr></thead><tbody>{body}</tbody></table>"


def _figure(value, digits: int = 4) -> str:
    return "" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def ending(run_dir: Path) -> tuple[str, str]:
    """(how the run ended, what to run next) from RUN_DIR/exit.json."""
    path = run_dir / "exit.json"
    if not path.is_file():
        return "unknown (no exit.json: the run is still going, or was killed hard)", (
            f"pretrainer train --run.dir={shlex.quote(str(run_dir))}"
        )
    exit_info = json.loads(path.read_text())
    reason = exit_info.get("reason", "?")
    said = (
        f"{reason} at step {exit_info.get('step', '?'):,}"
        if isinstance(exit_info.get("step"), int)
        else reason
    )
    if exit_info.get("message"):
        said += f": {exit_info['message']}"
    resume = f"pretrainer train --run.dir={shlex.quote(str(run_dir))}"
    if reason == "finished":  # a finished run goes on only past its horizon
        return said, f"{resume} --train.max_steps=MORE (to train past step {exit_info.get('step', '?')})"
    return said, f"{resume} (resumes from its newest checkpoint)"


def write_html(report_dir: Path, run, manifest: dict, records: list[dict], probes: list[dict] = ()) -> None:
    report_dir = Path(report_dir)
    run_dir = run.run_dir
    said, next_command = ending(run_dir)
    summary = [
        ("checkpoint", manifest["checkpoint"]),
        ("steps", _figure(manifest["steps"])),
        ("tokens", _figure(manifest["tokens"])),
        ("final train loss", _figure(manifest["final_train_loss"])),
        (
            f"validation loss (step {manifest.get('final_val_step')}, the last measured)",
            _figure(manifest["final_val_loss"]),
        ),
        ("validation bits per byte", _figure(manifest["final_val_bpb"])),
        ("task suite score", _figure(manifest["final_suite_score"])),
        ("wall time", f"{manifest['wall_time_s'] / 3600:.3f} h"),
        ("$ spent", _figure(manifest["spent_usd"], 2) if manifest["spent_usd"] is not None else "(no price)"),
        ("seed", manifest["seed"]),
    ]
    plots = "".join(
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,'
        f'{base64.b64encode((report_dir / name).read_bytes()).decode()}"><figcaption>'
        f"{html.escape(caption)}</figcaption></figure>"
        for name, caption in PLOTS.items()
        if (report_dir / name).is_file()
    )
    evals = [
        (
            r["step"],
            _figure(r.get("tokens")),
            _figure(r.get("val_loss")),
            _figure(r.get("val_bpb")),
            _figure(r.get("suite_score")),
        )
        for r in records
        if "val_loss" in r or "suite_score" in r
    ]
    happened = events(records)
    last = max((r["step"] for r in probes), default=None)  # each prompt's completion at the last probing
    probed = {r["prompt"]: r["completion"] for r in probes if r["step"] == last}
    probe_rows = [(prompt, completion) for prompt, completion in probed.items()]
    heading = ("prompt", f"greedy completion at step {last}")
    probes_table = _table(heading, probe_rows) if probe_rows else "<p>none (eval.tasks_every)</p>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(run_dir.name)}: pretrainer report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1.5rem; }}
th, td {{ border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; font-size: 0.9rem; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 1rem 0; }} img {{ max-width: 100%; }}
figcaption {{ font-size: 0.85rem; color: #555; }}
code, pre {{ background: #f6f6f6; padding: 0.1rem 0.3rem; }}
pre {{ padding: 0.6rem; overflow-x: auto; font-size: 0.8rem; }}
.ending {{ padding: 0.6rem 1rem; border-left: 4px solid #1f77b4; background: #f5f9fc; }}
</style></head>
<body>
<h1>{html.escape(run_dir.name)}</h1>
<p class="ending">Ended: <strong>{html.escape(said)}</strong><br>
Next: <code>{html.escape(next_command)}</code></p>
<h2>Summary</h2>
{_table(("figure", "value"), summary)}
<h2>Plan against actual</h2>
{_table(("figure", "planned", "actual"), plan_against_actual(run))}
<h2>Curves</h2>
{plots}
<h2>Evaluations</h2>
{_table(("step", "tokens", "val loss", "val bits/byte", "suite score"), evals) if evals else "<p>none</p>"}
<h2>Probes</h2>
{probes_table}
<h2>Events</h2>
{_table(("step", "event", "detail"), happened) if happened else "<p>no spikes, drills, rollbacks, alerts</p>"}
<h2>Config</h2>
<pre>{html.escape((run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else "")}</pre>
<p>Written by <code>pretrainer export</code> from {html.escape(str(run_dir))}; the figures are in
manifest.json and metrics.csv beside this page.</p>
<script>
// a plot that did not decode is a console error (the report's test renders this page in Chromium)
window.addEventListener("load", () => {{
  const broken = [...document.images].filter((img) => !img.naturalWidth).length;
  if (broken) console.error(broken + " plot(s) did not load");
}});
</script>
</body></html>
"""
    atomic_write_bytes(report_dir / "index.html", page.encode())
