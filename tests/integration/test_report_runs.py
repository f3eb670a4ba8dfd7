import csv
import json

import pytest
from helpers import tiny_config
from safetensors.torch import load_file
from support.report_helpers import modes, umask

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.ownership import OUTPUT_MARKER
from pretrainer.train.loop import train


@pytest.fixture(scope="module")
def finished_run(stdlib_data, tmp_path_factory):
    """20 steps with validation every 10 and in-loop tasks and probes every 10."""
    root = tmp_path_factory.mktemp("report")
    tasks = root / "toy.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"type": "mc", "context": f"x = {i} +", "choices": [" 1", " 2", " 3"], "gold": i % 3})
            + "\n"
            for i in range(12)
        )
    )
    probes = root / "probes.txt"
    probes.write_text("def main(\nimport os\\nimport\n")
    run = root / "run"
    train(
        tiny_config(
            stdlib_data,
            run,
            **{
                "train.max_steps": 20,
                "eval.every": 10,
                "track.backends": "mlflow",
                "budget.usd_per_gpu_hour": 2.0,
                "eval.tasks_every": 10,
                "eval.tasks": str(tasks),
                "eval.tasks_items": 8,
                "eval.probes": str(probes),
                "eval.probe_tokens": 6,
            },
        )
    )
    return run


def test_in_loop_tasks_and_probes_are_logged_and_reported(finished_run, tmp_path, run_cli):
    """eval.tasks_every scores the task subset (metrics.jsonl) and completes the probes
    (probes.jsonl) at the start, every N steps and at the end; the report plots the suite score
    against tokens and tables the probes."""
    records = read_metrics(finished_run / "metrics.jsonl")
    task_records = [r for r in records if "suite_score" in r]
    assert [r["step"] for r in task_records] == [0, 10, 20] and [r["tokens"] for r in task_records] == [
        0,
        10 * 512,
        20 * 512,
    ]
    assert all(
        set(r) >= {"acc_norm/toy", "tasks_eval_s", "elapsed_s"} and -0.5 <= r["suite_score"] <= 1
        for r in task_records
    )
    probes = read_metrics(finished_run / "probes.jsonl")
    assert [(r["step"], r["prompt"]) for r in probes] == [
        (s, p) for s in (0, 10, 20) for p in ("def main(", "import os\nimport")
    ]
    assert all(isinstance(r["completion"], str) for r in probes)
    code, _, err = run_cli("export", finished_run, "--out", tmp_path / "report")
    assert code == 0, err
    table = (tmp_path / "report" / "probes.md").read_text()
    assert table.count("| 10 | 5,120 |") == 2 and "## `import os\\nimport`" in table
    manifest = json.loads((tmp_path / "report" / "manifest.json").read_text())
    assert (
        manifest["final_suite_score"] == task_records[-1]["suite_score"]
        and manifest["probes_table"] == "probes.md"
    )
    rows = list(csv.DictReader(open(tmp_path / "report" / "metrics.csv")))
    assert {r["kind"] for r in rows if r["name"] == "suite_score"} == {"tasks"}


@pytest.fixture(scope="module")
def report(finished_run, tmp_path_factory):
    """finished_run's report, exported once for the tests that only read it."""
    from pretrainer.cli.main import main

    out = tmp_path_factory.mktemp("exported") / "report"
    assert main(["export", str(finished_run), "--out", str(out)]) == 0
    return out


PLOTS = ["loss-curve.png", "gradnorm-curve.png", "lr.png", "evals.png", "throughput.png", "mfu-cost.png"]


def test_export_writes_the_x1_report(finished_run, report):
    out = report
    assert {p.name for p in out.iterdir()} - {OUTPUT_MARKER} == {
        "manifest.json",
        "metrics.csv",
        *PLOTS,
        "index.html",
        "final.safetensors",
        "mlflow-run-uri.txt",
        "probes.md",
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plots"] == PLOTS and manifest["page"] == "index.html"
    assert manifest["seed"] == 1337 and manifest["steps"] == 20 and manifest["tokens"] == 20 * 8 * 64
    assert set(manifest["versions"]) >= {"python", "torch", "numpy", "tiktoken", "safetensors", "mlflow"}
    assert manifest["hardware"]["device_type"] == "cpu" and manifest["hardware"]["cpu_model"]
    records = read_metrics(finished_run / "metrics.jsonl")
    assert manifest["final_train_loss"] == [r["loss"] for r in records if "loss" in r][-1]
    assert manifest["final_val_loss"] == [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert manifest["final_val_bpb"] == [r["val_bpb"] for r in records if "val_loss" in r][-1]
    assert manifest["spent_usd"] == pytest.approx(2.0 * manifest["wall_time_s"] / 3600)
    assert manifest["final_weights"]["reload_resave_byte_identical"] is True
    weights = load_file(out / "final.safetensors")
    assert weights.keys() == load_file(latest_checkpoint(finished_run) / "model.safetensors").keys()
    run_id = (finished_run / "mlflow-run-id.txt").read_text().strip()
    assert f"run_id: {run_id}" in (out / "mlflow-run-uri.txt").read_text()


def test_metrics_csv_is_long_format_with_every_number(finished_run, report):
    rows = list(csv.DictReader(open(report / "metrics.csv")))
    records = read_metrics(finished_run / "metrics.jsonl")
    expected = sum(1 for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float)))
    assert len(rows) == expected and set(rows[0]) == {"step", "kind", "name", "value"}
    losses = [float(r["value"]) for r in rows if r["name"] == "loss"]
    assert losses == [r["loss"] for r in records if "loss" in r]


def test_plots_are_real_pngs_with_data(report):
    import matplotlib.image as mpimg
    import numpy as np

    # matplotlib C0, C1
    first_line, second_line = (np.array([0x1F, 0x77, 0xB4]) / 255, np.array([0xFF, 0x7F, 0x0E]) / 255)
    for name, lines in (
        ("loss-curve.png", 2),
        ("gradnorm-curve.png", 2),
        ("lr.png", 1),
        ("evals.png", 1),
        ("throughput.png", 1),
        ("mfu-cost.png", 1),  # $ spent (no MFU on a CPU)
    ):
        image = mpimg.imread(report / name)[..., :3]
        assert image.shape[0] > 300 and image.shape[1] > 500
        for colour in (first_line, second_line)[:lines]:  # the data lines are drawn, not just axes
            assert (np.abs(image - colour).max(axis=-1) < 0.05).sum() > 200, name


def test_exported_files_get_the_umask_mode(finished_run, tmp_path, run_cli):
    with umask(0o022):
        for fmt in ("report", "hf", "safetensors"):
            assert run_cli("export", finished_run, "--format", fmt, "--out", tmp_path / fmt)[0] == 0
    found = modes(tmp_path)
    assert {"hf/model.safetensors", "report/final.safetensors", "safetensors"} <= set(found)
    assert found == {name: 0o755 if (tmp_path / name).is_dir() else 0o644 for name in found}


def test_the_report_page_renders_in_a_real_browser_with_its_plots(finished_run, report, tmp_path):
    """index.html in headless Chromium: no console message (a plot that did not decode logs one), the
    plots drawn in the screenshot, nothing fetched from the network, and how the run ended."""
    from support.browser import plot_pixels, render

    page = (report / "index.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    assert page.count("data:image/png;base64,") == len(PLOTS)
    assert "Ended: <strong>finished at step 20</strong>" in page and "--run.dir=" in page
    assert "Plan against actual" in page and "<td>tokens</td><td>10,240</td><td>10,240</td>" in page
    console = render(report / "index.html", tmp_path / "page.png")
    assert console == [], console
    assert plot_pixels(tmp_path / "page.png") > 0.002

    broken = tmp_path / "broken.html"  # the check can fail: a plot that does not decode is a console error
    broken.write_text(page.replace("data:image/png;base64,iVBOR", "data:image/png;base64,XXXX", 1))
    assert any("did not load" in line for line in render(broken, tmp_path / "broken.png"))


def test_an_interrupted_run_s_report_keeps_serve_cost_and_shows_what_was_measured_last(
    stdlib_data, tmp_path, run_cli
):
    """A run stopped at step 5 whose in-loop validation ran at step 0 only, then `eval` and `serve-cost`:
    the report's validation loss is eval's at step 5 (it showed step 0's as "final"), its page has the
    evaluation and the probes, and `export --force` keeps serve-cost's files (it deleted them)."""
    from pretrainer.analysis.report.html import EVENT_STYLES, events
    from pretrainer.analysis.report.plots import TITLES

    run = tmp_path / "run"
    settings = {"train.max_steps": 20, "eval.every": 10, "train.stop_at_step": 5, "eval.tasks_every": 5}
    probes = tmp_path / "probes.txt"
    probes.write_text("def main(\nimport os\n")
    train(tiny_config(stdlib_data, run, **{**settings, "eval.probes": str(probes)}))
    assert run_cli("eval", run, "--tasks", "none")[0] == 0
    measured = json.loads((run / "eval-0000005.json").read_text())
    serve = ["--variants", "fp32", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0"]
    assert run_cli("serve-cost", run, *serve, "--val-batches", "1", "--new-tokens", "4")[0] == 0
    kept = {name: (run / "report" / name).read_bytes() for name in ("serve_cost.json", "serve_cost.md")}
    code, out, err = run_cli("export", run, "--force")
    assert code == 0, out + err
    assert {name: (run / "report" / name).read_bytes() for name in kept} == kept
    manifest = json.loads((run / "report" / "manifest.json").read_text())
    assert manifest["final_val_step"] == 5 and manifest["final_val_loss"] == measured["val_loss"]
    assert manifest["kept_from_other_verbs"] == sorted(kept)
    page = (run / "report" / "index.html").read_text()
    assert "validation loss (step 5, the last measured)" in page and f"{measured['val_loss']:,.4f}" in page
    assert "<h2>Probes</h2>" in page and "greedy completion at step 5" in page
    assert all(name in TITLES for name in manifest["plots"])  # each plot titled by what it shows
    # events: each kind its own colour, a normal finish is no event, a spike says what was flagged
    assert len({colour for colour, _ in EVENT_STYLES.values()}) == len(EVENT_STYLES)
    records = [
        {"step": 3, "spike": 1.0, "spike_loss": 9.5, "spike_grad_norm": 40.0, "skipped": 1.0},
        {"step": 20, "alert": "finished", "message": "finished at step 20"},
    ]
    assert events(records) == [(3, "spike", "loss 9.500, grad norm 40.000, update skipped")]
