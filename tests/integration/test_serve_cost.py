"""pretrainer serve-cost: fp32 vs int8 / int4 weight-only (torchao) on a tiny trained model: the
report's table and JSON, the quantised layers' bytes, what stayed unquantised, the quality deltas."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from helpers import tiny_overrides

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def tiny_run(stdlib_data, tmp_path_factory):
    from pretrainer.cli.main import main

    run_dir = tmp_path_factory.mktemp("serve") / "run"
    assert (
        main(
            [
                "train",
                *tiny_overrides(
                    stdlib_data, run_dir, **{"train.max_steps": 6, "ckpt.every": 6, "eval.every": 6}
                ),
            ]
        )
        == 0
    )
    return run_dir


FAST = [
    "--variants",
    "fp32,int8,int4",
    "--batch-sizes",
    "1,2",
    "--prompt-tokens",
    "16",
    "--new-tokens",
    "4",
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--val-batches",
    "1",
]


def test_serve_cost_tables_memory_and_quality_on_cpu(tiny_run, run_cli):
    code, out, err = run_cli("serve-cost", tiny_run, *FAST, "--usd-per-hour", "2.5", "--device", "cpu")
    assert code == 0, err
    result = json.loads((tiny_run / "report" / "serve_cost.json").read_text())
    table = (tiny_run / "report" / "serve_cost.md").read_text()
    assert (
        result["baseline"] == "fp32" and result["device"]["type"] == "cpu" and result["versions"]["torchao"]
    )
    by_name = {v["variant"]: v for v in result["variants"]}
    assert list(by_name) == ["fp32", "int8", "int4"] and all(v["status"] == "ok" for v in by_name.values())
    for name in by_name:
        assert f"| {name} | 1 |" in table and f"| {name} | 2 |" in table and f"| {name} |" in out

    fp32, int8, int4 = by_name["fp32"], by_name["int8"], by_name["int4"]
    q8 = int8["weights"]["quantised"]
    # 2 layers x (q, k, v, o, gate, up, down)
    assert q8["layers"] == 14 and q8["bytes"] <= 0.30 * q8["fp32_bytes"]
    assert int4["weights"]["quantised"]["bytes"] < q8["bytes"]  # packed two to a byte
    assert fp32["weights"]["ratio_to_fp32"] == 1.0
    # the embedding stays fp32: the whole model shrinks less
    assert q8["ratio_to_fp32"] < int8["weights"]["ratio_to_fp32"] < 1.0
    unquantised = {g["what"]: g for g in int8["weights"]["unquantised"]}
    assert unquantised["token embedding (= lm_head, tied)"]["dtype"] == "float32"
    assert "token embedding" in table and "int8 per output row" in table
    assert int8["weights"]["total_bytes"] == q8["bytes"] + sum(g["bytes"] for g in unquantised.values())

    for v in (int8, int4):
        quality = v["quality"]
        assert math.isfinite(quality["val_loss"]) and abs(quality["delta_val_loss"]) < 0.3
        assert quality["delta_val_loss"] == pytest.approx(quality["val_loss"] - fp32["quality"]["val_loss"])
        assert f"({quality['delta_val_loss']:+.4f})" in table  # reported, whatever its sign
    assert abs(int8["quality"]["delta_val_loss"]) < 0.02 and int8["quality"]["top1_agreement"] > 0.95
    for speed in int8["speed"]:
        assert speed["usd_per_million_generated"] == pytest.approx(
            2.5 / 3600 / speed["decode_tokens_per_s"] * 1e6
        )


def test_int8_logits_match_fp32_and_int4_skips_layers_its_group_size_does_not_divide(tiny_run):
    from pretrainer.analysis.serve_variants import load_variant
    from pretrainer.artifacts.runs import open_run
    from pretrainer.core.device import import_torchao

    import_torchao("this test")
    run, cpu = open_run(tiny_run), torch.device("cpu")
    x = torch.randint(run.cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fp32 = load_variant(run, run.cfg, "fp32", device=cpu, group_size=32)(x)[0]
        int8 = load_variant(run, run.cfg, "int8", device=cpu, group_size=32)(x)[0]
    assert (int8 - fp32).abs().max() < 0.02 * fp32.abs().max()

    entry = {}
    # d_model 64 and d_ff 192: no multiple of 128
    load_variant(run, run.cfg, "int4", device=cpu, group_size=128, entry=entry)
    skipped = {g["what"]: g["why"] for g in entry["weights"]["unquantised"]}
    assert entry["weights"]["quantised"]["layers"] == 0 and entry["quantised_layers"] == []
    assert skipped["layers.0.attn.q_proj.weight"] == "in_features 64 is not a multiple of --group-size 128"
    assert skipped["layers.1.mlp.down_proj.weight"] == "in_features 192 is not a multiple of --group-size 128"
    assert len([what for what in skipped if what.startswith("layers.")]) == 14


@pytest.mark.cuda
def test_serve_cost_runs_on_cuda(tiny_run, run_cli):
    out_dir = tiny_run / "cuda"
    code, _, err = run_cli(
        "serve-cost",
        tiny_run,
        *FAST,
        "--variants",
        "bf16,fp32,int8,int4",
        "--device",
        "cuda",
        "--out",
        out_dir,
    )
    assert code == 0, err
    result = json.loads((out_dir / "serve_cost.json").read_text())
    by_name = {v["variant"]: v for v in result["variants"]}
    assert result["device"]["type"] == "cuda" and list(by_name) == ["bf16", "fp32", "int8", "int4"]
    assert by_name["bf16"]["status"] == by_name["int8"]["status"] == "ok"
    assert all(v["status"] == "ok" or v["reason"] for v in by_name.values())  # a skipped variant says why
    q8 = by_name["int8"]["weights"]["quantised"]
    assert q8["layers"] == 14 and q8["bytes"] <= 0.30 * q8["fp32_bytes"]
    assert abs(by_name["int8"]["quality"]["delta_val_loss"]) < 0.05


def test_serve_cost_without_torchao_or_with_a_bad_variant_is_a_one_line_error(tiny_run, run_cli, monkeypatch):
    code, _, err = run_cli("serve-cost", tiny_run, "--variants", "fp32,fp8")
    assert code == 2 and err.startswith(
        "error: serve-cost: --variants takes distinct names from fp32, bf16, int8, int4"
    )
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    code, _, err = run_cli("serve-cost", tiny_run)
    hint = "error: serve-cost needs torchao: pip install torchao (from the checkout"
    assert code == 2 and err.startswith(hint)
    assert len(err.strip().splitlines()) == 1


def test_an_open_weights_baseline_gets_comparable_rows_in_the_same_table(tiny_run, run_cli, tmp_path):
    """--baseline on a local Hugging Face folder: the run's own model exported (`export --format hf`) is a
    baseline whose answer is known: the same weights through the same tokenizer score the same bits per
    byte as the run's fp32 row, in the same table with its memory, speed and $ per batch size."""
    hf_dir = tmp_path / "hf"
    code, _, err = run_cli("export", tiny_run, "--format", "hf", "--out", hf_dir)
    assert code == 0, err
    fast = FAST[:]
    fast[1], fast[3] = "fp32", "1"  # one variant, one batch size: the comparison, not the sweep
    out_dir = tmp_path / "report"
    code, out, err = run_cli(
        "serve-cost",
        tiny_run,
        *fast,
        "--usd-per-hour",
        "2.5",
        "--device",
        "cpu",
        "--baseline",
        hf_dir,
        "--out",
        out_dir,
    )
    assert code == 0, err
    result = json.loads((out_dir / "serve_cost.json").read_text())
    ours, theirs = result["variants"]
    assert ours["variant"] == "fp32" and theirs["variant"] == "baseline: hf" and theirs["status"] == "ok"
    assert theirs["quality"]["val_bpb"] == pytest.approx(ours["quality"]["val_bpb"], rel=0.02)
    assert theirs["quality"]["delta_val_bpb"] == pytest.approx(
        theirs["quality"]["val_bpb"] - ours["quality"]["val_bpb"]
    )
    assert theirs["weights"]["total_bytes"] == pytest.approx(ours["weights"]["total_bytes"], rel=0.01)
    assert [s["batch"] for s in theirs["speed"]] == [1]
    for speed in theirs["speed"]:
        assert speed["usd_per_million_generated"] == pytest.approx(
            2.5 / 3600 / speed["decode_tokens_per_s"] * 1e6
        )
    table = (out_dir / "serve_cost.md").read_text()
    assert "| baseline: hf | 1 |" in table and "(n/a)" in table
    # not a model folder: one line naming it
    code, _, err = run_cli(
        "serve-cost", tiny_run, *fast, "--device", "cpu", "--baseline", tmp_path, "--out", out_dir
    )
    assert code == 2 and str(tmp_path) in err and len(err.strip().splitlines()) == 1
