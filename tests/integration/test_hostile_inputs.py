"""Careless and hostile inputs, second round: each is one `error:` line with exit 2 (or the
right behaviour), never a traceback, and a run that computes nothing finite is an error, not a finish."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_overrides
from safetensors.torch import load_file, save_file

from pretrainer.cli.main import main


@pytest.fixture(scope="module")
def small_run(stdlib_data, tmp_path_factory) -> Path:
    """A finished 10-step run, only read by the tests that use it."""
    from helpers import tiny_config

    from pretrainer.train.loop import train

    run = tmp_path_factory.mktemp("small") / "run"
    train(tiny_config(stdlib_data, run, **{"train.max_steps": 10, "eval.every": 10}))
    return run


def one_line(argv: list, capsys) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and captured.err.startswith("error: "), (
        captured.out[-2000:] + captured.err[-3000:]
    )
    return captured.err


def test_bad_values_anywhere_are_one_line(small_run, stdlib_data, tmp_path, capsys):
    run = tmp_path / "run"
    train = ["train", *tiny_overrides(stdlib_data, run)]
    assert "data.mixture" in one_line([*train, f"--data.mixture={stdlib_data}:inf,{stdlib_data}:1"], capsys)
    assert "model.rope_theta" in one_line([*train, "--model.rope_theta=1e-320"], capsys)
    sweep = [
        "sweep",
        "--tokens",
        "1000",
        "--out",
        tmp_path / "sweep",
        "--dry-run",
        f"--data.dir={stdlib_data}",
    ]
    assert "must be a positive finite number" in one_line([*sweep, "--sizes", "1e400"], capsys)
    assert "needs at least 1 layer" in one_line([*sweep, "--sizes", "0x0"], capsys)
    binary = tmp_path / "runs.csv"
    binary.write_bytes(bytes(range(256)) * 16)
    assert "not a CSV text file" in one_line(["fit", binary], capsys)
    err = one_line(["sample", small_run, "--num-samples", "100000000"], capsys)
    assert "--num-samples 100,000,000: sampling them at once needs about" in err
    hf = tmp_path / "hf"
    assert main(["export", str(small_run), "--format", "hf", "--out", str(hf)]) == 0
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "vocab_size": "big"}))
    assert "vocab_size must be a positive integer" in one_line([*train, f"--init.from=hf:{hf}"], capsys)
    (hf / "config.json").write_text("{not json")
    assert "not valid JSON" in one_line([*train, f"--init.from=hf:{hf}"], capsys)
    err = one_line([*train, f"--model.{'x' * 1_000_000}=1"], capsys)
    assert len(err) < 300 and "(1,000,006 characters)" in err  # model. + the name
    assert not run.exists(), "refused before the run dir was made"


def test_a_tiny_temperature_is_greedy_not_a_traceback(small_run, capsys):
    outputs = []
    for temperature in ("0", "1e-300"):
        assert main(["sample", str(small_run), "--prompt", "def ", "--temperature", temperature]) == 0
        outputs.append(capsys.readouterr().out.split("\n", 1)[1])  # after the header naming the temperature
    assert outputs[0] == outputs[1]


DRILL = {
    "spike.inject_at_step": 3,
    "spike.inject_kind": "lr",
    "spike.lr_factor": 1e18,
    "spike.inject_batches": 1,
}


@pytest.mark.parametrize(
    "start, settings, said",
    [
        (
            "nan-weights",
            {},
            "step 0: validation loss nan: the model's outputs are not finite before any update",
        ),
        ("fresh", {**DRILL, "eval.every": 5}, "step 5: validation loss nan: the model is broken"),
        ("fresh", {**DRILL, "eval.every": 0, "spike.max_consecutive": 3}, "not finite for 3 steps in a row"),
    ],
)
def test_a_model_that_computes_nothing_finite_ends_as_an_error(
    small_run, stdlib_data, tmp_path, capsys, start, settings, said
):
    """It trained NaN from step 0 (every update skipped) and ended "finished", exit 0. The model: weights
    with a NaN (a bad download), or an LR 1e18 times too large for one step (the spike drill)."""
    run = tmp_path / "run"
    if start == "nan-weights":
        hf = tmp_path / "hf"
        assert main(["export", str(small_run), "--format", "hf", "--out", str(hf)]) == 0
        weights = load_file(hf / "model.safetensors")
        next(v for k, v in weights.items() if "o_proj" in k)[0, 0] = float("nan")
        save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
        settings = {"init.from": f"hf:{hf}"}
    argv = ["train", *tiny_overrides(stdlib_data, run, **{"train.max_steps": 30, **settings})]
    err = one_line(argv, capsys)
    assert said in err and "check init.from's weights, model.rope_theta" in err, err
    record = json.loads((run / "exit.json").read_text())
    assert record["reason"] == "error" and record["exit_code"] == 2
    assert not list((run / "checkpoints").glob("step-*")), "no checkpoint of a model that computes nan"


@pytest.mark.parametrize("verb", ["eval", "serve-cost"])
def test_a_reader_that_stops_early_loses_no_file(small_run, tmp_path, verb):
    """`pretrainer eval RUN | head -1`: a BrokenPipeError lost eval's JSON (serve-cost's files too)."""
    run = shutil.copytree(small_run, tmp_path / "run")
    out = tmp_path / "serve"
    argv = {
        "eval": ["eval", run, "--tasks", "none"],
        "serve-cost": ["serve-cost", run, "--variants", "fp32", "--batch-sizes", "1", "--repeats", "1"]
        + ["--warmup", "0", "--val-batches", "1", "--new-tokens", "4", "--out", out],
    }[verb]
    child = subprocess.Popen(
        [sys.executable, "-m", "pretrainer", *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child.stdout.readline()  # `| head -1`
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(120) == 0 and "Traceback" not in err, err
    written = list(run.glob("eval-*.json")) if verb == "eval" else list(out.glob("serve_cost.*"))
    assert written, err


def test_exit_json_names_the_checkpoint_by_its_absolute_path(stdlib_data, tmp_path, monkeypatch):
    """A run dir given relatively: exit.json's checkpoint and run dir are absolute, as every saved path."""
    monkeypatch.chdir(tmp_path)
    assert (
        main(["train", *map(str, tiny_overrides(stdlib_data, Path("rel-run"), **{"train.max_steps": 2}))])
        == 0
    )
    record = json.loads((tmp_path / "rel-run" / "exit.json").read_text())
    assert record["checkpoint"] == str(tmp_path / "rel-run" / "checkpoints" / "step-0000002")
    assert record["run_dir"] == str(tmp_path / "rel-run")
