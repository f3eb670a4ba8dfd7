"""a CLI a newcomer can drive. A run dir is enough after the first command; likely
mistakes are said at start; logs read well in a file; outputs land where the layout says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import tiny_overrides

from pretrainer.config.load import load_config


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, stdlib_data):
    """A run started with relative paths and model overrides, stopped at step 3 of 6."""
    from pretrainer.cli.main import main

    base = tmp_path_factory.mktemp("cli")
    (base / "data").symlink_to(stdlib_data)
    cwd, data_files = os.getcwd(), sorted(os.listdir(stdlib_data))
    os.chdir(base)
    try:
        overrides = tiny_overrides(
            Path("data"),
            Path("runs/tiny"),
            **{
                "train.max_steps": 6,
                "train.stop_at_step": 3,
                "ckpt.every": 3,
                "eval.every": 3,
                "optim.warmup_steps": 50,
                "log.every": 2,
                "model.d_model": 32,
                "model.n_head": 2,
                "model.n_kv_head": 1,
            },
        )
        assert main(["train", *overrides]) == 0
    finally:
        os.chdir(cwd)
    # problem 6: no cache written into the input data dir
    assert sorted(os.listdir(stdlib_data)) == data_files
    return base / "runs" / "tiny"


def test_a_run_dir_is_enough_to_resume_from_anywhere(stopped_run, tmp_path, monkeypatch, run_cli):
    """Problem 1: `train --run.dir=R` resumes with R's saved config, no override retyped, from another
    directory."""
    monkeypatch.chdir(tmp_path)
    # the first launch's stop_at_step = 3 is not the run's
    code, out, err = run_cli("train", f"--run.dir={stopped_run}")
    assert code == 0 and "resuming from" in out and "finished at step 6" in out
    assert "warning: optim.warmup_steps = 50 > train.max_steps = 6: the LR never reaches" in out  # problem 3
    saved = load_config(stopped_run / "config.toml")
    assert Path(saved.data.dir).is_absolute() and saved.model.d_model == 32
    # the log: one line per logged step, no carriage returns off a terminal, and what to run next
    assert "step 4/6 | loss " in out and " | lr " in out and " | grad norm " in out and " tok/s | ETA " in out
    assert "\r" not in out + err  # no progress bar off a terminal
    assert f"pretrainer sample {stopped_run}" in out and f"pretrainer export {stopped_run} --format hf" in out


def test_resume_reports_only_real_changes_and_refuses_a_new_model_with_the_old_values(
    stopped_run, run_cli, stdlib_data
):
    code, out, _ = run_cli("train", f"--run.dir={stopped_run}", "--optim.lr=0.001")
    assert code == 0 and "changed config keys: optim.lr: 0.003 -> 0.001" in out
    # relative then, absolute now: the same dir
    assert "data.dir" not in out.split("changed config keys")[1].splitlines()[0]
    overrides = tiny_overrides(
        stdlib_data, stopped_run, **{"train.max_steps": 6, "model.n_head": 2, "model.n_kv_head": 1}
    )
    code, _, err = run_cli("train", *overrides)  # model.d_model = 64 now: the checkpoint has 32
    assert code == 2 and "was trained with model.d_model = 32 (this launch: 64)" in err
    assert f"pretrainer train --run.dir={stopped_run}" in err and "use a new run.dir" in err


def test_eval_sample_export_postmortem_take_the_run_dir_alone(
    stopped_run, tmp_path, monkeypatch, run_cli, stdlib_data
):
    monkeypatch.chdir(tmp_path)
    checkpoint = sorted((stopped_run / "checkpoints").iterdir())[-1]
    for target in (
        [str(stopped_run)],
        [str(checkpoint), "--eval.batches=2"],
        [f"--run.dir={stopped_run}"],
        [str(stopped_run / "config.toml")],
    ):  # the saved config works from any directory
        code, out, err = run_cli("eval", *target)
        assert code == 0 and "val loss" in out, err
    code, out, _ = run_cli("sample", stopped_run, "--max-new-tokens", "5")
    assert code == 0 and "--- sample 1 ---" in out
    code, out, _ = run_cli("postmortem", checkpoint)
    assert code == 0 and "No spike could be detected" in out and "No spikes were" not in out
    assert (
        "No spike could be detected: the detector starts after spike.min_values = 64"
        in (stopped_run / "spike-postmortem.md").read_text()
    )  # problem 3: not "no spikes" from a detector that never ran

    # export: RUN/report and RUN/hf by default, an existing output only with --force
    code, out, _ = run_cli("export", stopped_run)
    assert code == 0 and (stopped_run / "report" / "manifest.json").is_file()
    code, _, err = run_cli("export", stopped_run)
    assert code == 2 and "already exists; pass --force" in err
    assert run_cli("export", stopped_run, "--force")[0] == 0
    code, out, err = run_cli("export", stopped_run, "--format", "hf")
    assert code == 0 and (stopped_run / "hf" / "config.json").is_file(), err
    # and the exported model evaluates with no model.* flags: the shape comes from the weights
    for hf in ([f"hf:{stopped_run / 'hf'}"], [f"--init.from=hf:{stopped_run / 'hf'}"]):
        code, out, err = run_cli("eval", *hf, f"--data.dir={stdlib_data}", "--eval.batches=2")
        assert code == 0 and "val loss" in out, err
    code, _, err = run_cli("eval")
    assert code == 2 and "say what to evaluate: RUN_DIR_OR_CHECKPOINT or hf:DIR" in err


def test_export_gguf_writes_one_llama_cpp_file(stopped_run, run_cli, capsys):
    """RUN/model-f16.gguf by default; a dtype GGUF export does not write is one error line. (The file
    read back tensor by tensor: tests/unit/artifacts/test_gguf_format.py; llama.cpp's generations:
    benchmarks/gguf_llamacpp.py.)"""
    import gguf

    code, out, err = run_cli("export", stopped_run, "--format", "gguf")
    assert code == 0, err
    assert out.endswith(f"as gguf (f16) to {stopped_run / 'model-f16.gguf'}\n")
    reader = gguf.GGUFReader(stopped_run / "model-f16.gguf")
    # the default llama (QK-norm) is llama.cpp's qwen3: token_embd, output_norm and 11 per layer (9 and the
    # q and k norms; tied: no output.weight)
    assert reader.fields["general.architecture"].contents() == "qwen3" and len(reader.tensors) == 2 + 2 * 11
    for dtype in ("bf16", "q4_k"):  # a dtype of another format, one of none
        try:
            code, _, err = run_cli("export", stopped_run, "--format", "gguf", "--dtype", dtype)
        except SystemExit as e:  # argparse's, one line too
            code, err = e.code, capsys.readouterr().err
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    code, _, err = run_cli("export", stopped_run, "--format", "gguf")
    assert code == 2 and "already exists; pass --force" in err
    assert run_cli("export", stopped_run, "--format", "gguf", "--force")[0] == 0


def test_saved_configs_are_completed_by_overrides_then_checked(stopped_run, tmp_path):
    """Overrides are checked against the saved config they complete, not the defaults; a chosen
    checkpoint (train.resume=PATH) brings its own config."""
    from pretrainer.artifacts.run_config import load_train_config
    from pretrainer.config.keys import save_config

    run = tmp_path / "priced"
    run.mkdir()
    save_config(
        load_config(None, ["--budget.usd_per_gpu_hour=2", "--train.stop_at_step=5"]), run / "config.toml"
    )
    # the defaults have no price: invalid alone
    cfg = load_train_config(None, [f"--run.dir={run}", "--budget.cap_usd=50"])
    assert (cfg.budget.cap_usd, cfg.budget.usd_per_gpu_hour, cfg.train.stop_at_step) == (50, 2, 0)
    checkpoint = sorted((stopped_run / "checkpoints").iterdir())[0]
    cfg = load_train_config(None, [f"--run.dir={tmp_path / 'branch'}", f"--train.resume={checkpoint}"])
    assert (
        cfg.model.d_model == 32
        and cfg.run.dir == str(tmp_path / "branch")
        and cfg.train.resume == str(checkpoint)
    )


def test_eval_runs_in_context_tasks_and_writes_the_results(stopped_run, tmp_path, run_cli):
    """`eval RUN --tasks FILE` prints the table and the suite score; bpb and tasks go to
    eval-STEP.json."""
    import json

    tasks = tmp_path / "toy.jsonl"
    items = [
        {"type": "mc", "context": f"def f{i}(x):\n    return", "choices": [" x", " None", " 1"], "gold": 0}
        for i in range(4)
    ]
    items += [{"type": "lm", "context": "import", "continuation": " os"}]
    tasks.write_text("".join(json.dumps(item) + "\n" for item in items))
    code, out, err = run_cli("eval", stopped_run, "--tasks", tasks, "--num-fewshot", "1", "--eval.batches=1")
    assert code == 0, err
    assert "toy" in out and "acc_norm" in out and "suite score (mean centered accuracy over 1 tasks)" in out
    assert "probes (greedy):" in out and "The capital of France is ->" in out
    saved = json.loads(sorted(stopped_run.glob("eval-*.json"))[-1].read_text())
    assert saved["tasks"][0]["items"] == 5 and saved["tasks"][0]["chance"] == pytest.approx(4 / 3 / 5)
    assert saved["tasks"][0]["num_fewshot"] == 1 and len(saved["probes"]) == 7
    assert {"val_loss", "val_bpb", "suite_score"} <= saved.keys()
    code, out, _ = run_cli(
        "eval", stopped_run, "--tasks", tasks, "--limit", "2", "--eval.batches=1", "--eval.probe_tokens=2",
        "--eval.probes=code",
    )  # fmt: skip
    saved = json.loads(sorted(stopped_run.glob("eval-*.json"))[-1].read_text())
    assert code == 0 and saved["tasks"][0]["items"] == 2
    # a model of code is asked about code: the built-in code set, no capital of France
    assert len(saved["probes"]) == 4 and "class Error(Exception):\\n ->" in out and "France" not in out
    (tmp_path / "bad.jsonl").write_text('{"type": "mc", "context": "x", "choices": [" a"], "gold": 0}\n')
    code, _, err = run_cli("eval", stopped_run, "--tasks", tmp_path / "bad.jsonl")
    assert code == 2 and "bad.jsonl:1: needs a list of at least 2 non-empty choices" in err
