import json
import math
from pathlib import Path

import pytest

from pretrainer.analysis.plan import make_plan
from pretrainer.config.load import load_config
from pretrainer.core.errors import UserError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_plan_cli_prints_the_published_llama3_1b_count(run_cli):
    code, out, _ = run_cli("plan", CONFIGS / "llama3-1b.toml")
    assert code == 0 and "1,241,581,568" in out


@pytest.mark.parametrize(
    "name, total, non_embedding",
    [
        # GPT-2's published 124,439,808 at 50,257 rows, padded to 50,304 (47 x 768 more)
        ("gpt2-124m.toml", 124_439_808 + 47 * 768, 124_439_808 - 50257 * 768 - 1024 * 768),
        ("x1-50m.toml", 88_942_080, 50_344_704),
        ("llama3-1b.toml", 1_241_581_568, 1_241_581_568 - 131072 * 2048),
    ],
)
def test_seed_configs_have_their_published_sizes(name, total, non_embedding):
    plan = make_plan(load_config(CONFIGS / name))
    assert plan["params_total"] == total and plan["params_non_embedding"] == non_embedding


def test_gpt2_flops_tokens_and_steps_by_hand(run_cli):
    plan = make_plan(load_config(CONFIGS / "gpt2-124m.toml"), tokens=10e9, gpus=8)
    non_embedding = 124_439_808 - 50257 * 768 - 1024 * 768
    n_matmul = non_embedding + 50304 * 768  # the tied output projection (padded rows) is still a matmul
    # causal: 6 * n_layer * n_head * head_dim * seq_len (nanoGPT's 12 counts the masked half too)
    attention = 6 * 12 * 12 * 64 * 1024
    assert plan["flops_per_token"] == 6 * n_matmul + attention == 798_759_936
    assert plan["tokens_per_step"] == 16 * 1024 * 4 * 8 == 524_288
    assert plan["steps"] == math.ceil(10e9 / 524_288) == 19_074
    code, out, _ = run_cli("plan", CONFIGS / "gpt2-124m.toml", "--tokens", "10e9", "--gpus", "8", "--json")
    assert code == 0 and json.loads(out)["steps"] == 19_074


def test_chinchilla_budget_and_overrides(run_cli):
    plan = make_plan(load_config(CONFIGS / "x1-50m.toml", ["--train.grad_accum=8"]), tokens_per_param=20)
    assert plan["token_budget"] == plan["chinchilla_tokens"] == 20 * 88_942_080
    assert plan["tokens_per_step"] == 32 * 1024 * 8
    code, out, _ = run_cli("plan", CONFIGS / "x1-50m.toml", "--tokens-per-param", "100", "--model.n_layer=4")
    assert code == 0 and "100 tokens per parameter" in out


def test_plan_needs_a_vocab_and_says_where_to_get_one():
    with pytest.raises(UserError, match="model.vocab_size is 0.*--data.dir=DIR"):
        make_plan(load_config(None))


def test_plan_plans_what_the_config_will_do(run_cli):
    """the plan's steps are train.max_steps (overrides included), with Chinchilla for reference."""
    code, out, _ = run_cli(
        "plan",
        CONFIGS / "gpt2-124m.toml",
        "--gpus",
        "8",
        "--gpu",
        "h100-sxm",
        "--usd-per-gpu-hour",
        "2.5",
        "--json",
    )
    plan = json.loads(out)
    assert code == 0 and plan["steps"] == 19_073 and plan["token_budget_source"] == "train.max_steps"
    assert plan["chinchilla_steps"] == math.ceil(20 * 124_475_904 / 524_288) == 4_749
    code, out, _ = run_cli(
        "plan", CONFIGS / "gpt2-124m.toml", "--gpus", "8", "--train.max_steps=1000", "--json"
    )
    assert json.loads(out)["steps"] == 1000
    code, out, _ = run_cli(
        "plan",
        CONFIGS / "gpt2-124m.toml",
        "--gpus",
        "8",
        "--train.max_steps=1000",
        "--tokens-per-param",
        "20",
    )
    assert "4,749 (20 tokens per parameter)" in out and "the config trains 1,000 steps" in out


def test_plan_takes_price_mfu_and_cap_from_the_budget_section(run_cli):
    budget = [
        "--budget.usd_per_gpu_hour=2",
        "--budget.mfu=0.5",
        "--budget.cap_usd=10",
        "--budget.peak_tflops=100",
    ]
    plan = make_plan(load_config(CONFIGS / "gpt2-124m.toml", budget), gpus=8)
    hours = plan["training_flops"] / (8 * 100e12 * 0.5) / 3600
    assert (
        plan["mfu"] == 0.5
        and plan["wall_hours"] == pytest.approx(hours)
        and plan["cost_usd"] == pytest.approx(hours * 8 * 2)
    )
    assert any("exceeds budget.cap_usd = $10.00" in w for w in plan["warnings"])
    code, out, _ = run_cli("plan", CONFIGS / "gpt2-124m.toml", "--gpus", "8", *budget, "--mfu", "0.25")
    assert code == 0 and "at MFU 0.25" in out and "warning" in out and "exceeds budget.cap_usd" in out


def test_plan_takes_the_vocab_from_a_data_dir(run_cli, stdlib_data):
    code, _, err = run_cli("plan", CONFIGS / "tiny-cpu.toml")
    assert code == 2 and "--data.dir=DIR" in err
    code, out, _ = run_cli("plan", CONFIGS / "tiny-cpu.toml", f"--data.dir={stdlib_data}", "--json")
    assert code == 0 and json.loads(out)["vocab_size"] == 1024


def test_plan_json_into_a_closed_pipe_is_quiet(monkeypatch, capsys):
    """`pretrainer plan --json | head`: the reader is gone before the plan is printed; no BrokenPipeError."""
    import os
    import sys

    from pretrainer.cli.main import main

    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    assert main(["plan", str(CONFIGS / "gpt2-124m.toml"), "--json"]) == 0
    broken.write("more")  # stdout now points at /dev/null: the flush at exit does not fail either
    broken.flush()
    monkeypatch.undo()
    broken.close()


def test_x1_lab_budget_by_hand(run_cli):
    """The X1 lab: 50M non-embedding params, ~43B tokens, 1 A100 at MFU 0.48, $1.10/h -> ~24 h, $26-29.
    The lab counts C = 6ND with N = non-embedding parameters (--flops 6n)."""
    cfg = load_config(CONFIGS / "x1-50m.toml")
    plan = make_plan(
        cfg, tokens=43e9, gpu="a100-80gb", mfu=0.48, usd_per_gpu_hour=1.10, flops_convention="6n"
    )
    steps = math.ceil(43e9 / 524_288)
    hours = 6 * 50_344_704 * steps * 524_288 / (312e12 * 0.48) / 3600
    assert plan["wall_hours"] == pytest.approx(hours) and 23.5 < hours < 24.5
    assert plan["cost_usd"] == pytest.approx(hours * 1.10) and 26 <= plan["cost_usd"] <= 29
    assert plan["energy_kwh"] == pytest.approx(hours * 0.400)
    # Full accounting (output projection + causal attention) ~doubles the work: the 24 h plan needs ~90% MFU.
    full = make_plan(cfg, tokens=43e9, gpu="a100-80gb", mfu=0.48, usd_per_gpu_hour=1.10)
    n_matmul = 50_344_704 + 50257 * 768
    assert full["flops_per_token"] == 6 * n_matmul + 6 * 8 * 768 * 1024 == 571_401_216
    assert full["wall_hours"] == pytest.approx(571_401_216 * steps * 524_288 / (312e12 * 0.48) / 3600)
    code, out, _ = run_cli(
        "plan",
        CONFIGS / "x1-50m.toml",
        "--gpu",
        "a100-80gb",
        "--mfu",
        "0.48",
        "--usd-per-gpu-hour",
        "1.10",
        "--tokens",
        "43e9",
        "--flops",
        "6n",
    )
    assert code == 0 and "$26.50" in out and "24.09 h" in out


def test_unknown_gpu_needs_peak_tflops(run_cli):
    code, _, err = run_cli("plan", CONFIGS / "gpt2-124m.toml", "--gpu", "mystery-9000")
    assert code == 2 and "unknown GPU 'mystery-9000'; pass --peak-tflops" in err
    plan = make_plan(
        load_config(CONFIGS / "gpt2-124m.toml"),
        gpu="mystery-9000",
        peak_tflops=100,
        gpus=2,
        tokens=1e9,
        mfu=0.5,
    )
    assert plan["wall_hours"] == pytest.approx(plan["training_flops"] / (2 * 100e12 * 0.5) / 3600)
    assert "energy_kwh" not in plan and "max_micro_batch" not in plan["memory_per_gpu_bytes"]


def test_memory_estimate_by_hand():
    cfg = load_config(CONFIGS / "x1-50m.toml", ["--train.micro_batch=2", "--parallel.strategy=fsdp"])
    plan = make_plan(cfg, gpus=4, gpu="h100-sxm")
    m, params = plan["memory_per_gpu_bytes"], 88_942_080
    assert (m["weights"], m["gradients"]) == (4 * params // 4, 4 * params // 4)
    # + a 4-byte step count per tensor, shards rounded up
    assert m["optimizer"] == pytest.approx(8 * params / 4, rel=1e-3)
    # bytes per token per layer (bf16 activations, fp32 residual)
    per_layer = 30 * 768 + 4 * 256 + 8 * 2048 + 4 * 12 + 8
    per_layer += 6 * 768 + 4 * 256  # QK-norm (a llama's default): the normed q and k and their inputs
    per_token = 8 * per_layer + 10 * 768 + 12
    assert m["activations"] == 2 * 1024 * per_token
    assert m["loss_gradient"] == 4 * 50257 * 768 and m["ddp_buckets"] == 0
    fixed = (
        8 * params // 4
        + m["optimizer"]
        + int(1.5 * 2**30)
        + m["bf16_weights"]
        + m["loss_gradient"]
        + m["loss_chunk"]
    )
    assert m["total"] == fixed + m["activations"] and m["fits"]
    assert m["max_micro_batch"] == int((80e9 - fixed) // (1024 * per_token))
    low_bit = make_plan(
        load_config(CONFIGS / "x1-50m.toml", ["--train.micro_batch=2", "--optim.name=adamw8bit"]), gpus=4
    )
    assert low_bit["memory_per_gpu_bytes"]["optimizer"] == pytest.approx(
        m["optimizer"] * 4 * 2.03 / 8, rel=0.01
    )  # DDP: unsharded, ~2.03 bytes
    assert m["max_micro_batch_checkpointed"] > m["max_micro_batch"]


def test_the_1b_config_under_ddp_fits_80gb_with_every_item_counted(run_cli):
    """8 x H100 80 GB, micro-batch 8 at seq 2048, DDP: the estimate names every item."""
    code, out, _ = run_cli(
        "plan", CONFIGS / "llama3-1b.toml", "--gpus", "8", "--gpu", "h100-sxm", "--train.micro_batch=8"
    )
    assert code == 0
    assert "DDP buckets: views, +0" in out and "bf16 weight copies" in out and "(output gradient)" in out
    assert "at micro-batch 8 -> total" in out and "(fits in 80 GB)" in out


def test_fsdp_over_two_nodes_plans_the_shards_of_one_node():
    """16 GPUs (2 nodes of 8) with FSDP: HSDP shards within a node, so each GPU holds an eighth of the
    weights, as on one node; parallel.fsdp_shard = all splits them 16 ways."""
    node = make_plan(
        load_config(CONFIGS / "llama3-1b.toml", ["--parallel.strategy=fsdp", "--train.micro_batch=8"]),
        gpus=16,
    )
    one_node = make_plan(
        load_config(CONFIGS / "llama3-1b.toml", ["--parallel.strategy=fsdp", "--train.micro_batch=8"]), gpus=8
    )
    everywhere = make_plan(
        load_config(
            CONFIGS / "llama3-1b.toml",
            ["--parallel.strategy=fsdp", "--parallel.fsdp_shard=all", "--train.micro_batch=8"],
        ),
        gpus=16,
    )
    weights = [p["memory_per_gpu_bytes"]["weights"] for p in (node, one_node, everywhere)]
    assert weights[0] == weights[1] == 4 * 1_241_581_568 // 8 and weights[2] == 4 * 1_241_581_568 // 16


def test_compare_on_the_x1_lab_prints_its_budget_lines_and_every_instance(run_cli, tmp_path):
    """plan --compare on x1-lab00.toml: the lab's bill (compute, data preparation, disk, restart reserve,
    total against the cap, go/no-go at its $1.40 limit) and one row per instance type, cheapest marked."""
    code, out, _ = run_cli("plan", CONFIGS / "x1-lab00.toml", "--compare", "--json")
    plan = json.loads(out)
    bill, hours = plan["bill"], plan["wall_hours"]
    lines = {line["line"]: line["usd"] for line in bill["lines"]}
    restart_h = (plan["checkpointing"]["startup_s"] + 1800 * hours * 3600 / 84_000) / 3600
    assert lines == pytest.approx(
        {
            "compute": hours * 1.10,
            "data preparation": 0.5 * 1.10 + 1.0,
            "persistent disk": 200 * (hours + 0.5) / 730 * 0.30,
            "restart reserve": restart_h * 1.10,
        }
    )
    assert bill["total_usd"] == pytest.approx(sum(lines.values())) and bill["cap_usd"] == 35.0
    assert bill["max_usd_per_gpu_hour"] == 1.40 and bill["go"] is (bill["total_usd"] <= 35.0)
    rows = plan["compare"]
    assert len(rows) >= 9 and sum(bool(row.get("cheapest")) for row in rows) == 1
    cheapest = min((row for row in rows if row["fits"]), key=lambda row: row["total_usd"])
    assert cheapest.get("cheapest")
    for row in (row for row in rows if row["fits"]):  # the same run: its global batch on every instance
        assert row["micro_batch"] * row["grad_accum"] * row["count"] == 512
        assert row["micro_batch"] <= row["largest_micro_batch"]
    eight = next(row for row in rows if row["instance"] == "lambda-8x-a100-80gb")
    one = next(row for row in rows if row["instance"] == "lambda-1x-a100-80gb-spot")
    assert eight["wall_hours"] == pytest.approx(one["wall_hours"] / 8)  # the same MFU, 8x the GPUs
    code, text, _ = run_cli("plan", CONFIGS / "x1-lab00.toml", "--compare")
    for label in (
        "compute",
        "data preparation",
        "persistent disk",
        "restart reserve",
        "go/no-go",
        "<- cheapest",
    ):
        assert label in text
    # a price table of one's own: a row replaced, a row added; a broken one is one line naming the file
    prices = tmp_path / "prices.toml"
    prices.write_text(
        '[[instance]]\nname = "lambda-1x-a100-80gb-spot"\ngpu = "a100-80gb"\ncount = 1\n'
        "usd_per_gpu_hour = 0.5\n"
        '[[instance]]\nname = "mine"\ngpu = "h100-sxm"\ncount = 4\nusd_per_gpu_hour = 2.0\n'
    )
    code, out, _ = run_cli("plan", CONFIGS / "x1-lab00.toml", "--compare", "--prices", prices, "--json")
    rows = {row["instance"]: row for row in json.loads(out)["compare"]}
    assert rows["lambda-1x-a100-80gb-spot"]["usd_per_gpu_hour"] == 0.5 and rows["mine"]["count"] == 4
    prices.write_text('[[instance]]\nname = "x"\ngpu = "a100-80gb"\n')
    code, _, err = run_cli("plan", CONFIGS / "x1-lab00.toml", "--compare", "--prices", prices)
    assert code == 2 and str(prices) in err and len(err.strip().splitlines()) == 1


def test_auto_checkpoints_from_measured_times_and_every_figure_says_where_it_came_from():
    from pretrainer.train.cadence import preemption_cost, young_daly_steps

    timings = {
        "run_dir": "probe",
        "step_s": 0.8,
        "tokens_per_s": 524_288 / 0.8,
        "eval_s": 30.0,
        "checkpoint_s": 6.0,
        "startup_s": 90.0,
        "run_steps": 40,
        "run_wall_s": 130.0,
    }
    cfg = load_config(CONFIGS / "x1-lab00.toml", ["--ckpt.every=auto", "--ckpt.interruptions_per_hour=0.2"])
    plan = make_plan(cfg, timings=timings)
    c = plan["checkpointing"]
    assert c["every"] == young_daly_steps(6.0, 0.8, 0.2) and c["write_source"] == "measured"
    lost = preemption_cost(
        plan["wall_hours"] * 3600, c["every"], 0.8, write_s=6.0, startup_s=90.0, per_hour=0.2
    )["lost_s"]
    assert c["lost_s"] == pytest.approx(lost)
    assert {line["line"]: line["usd"] for line in plan["bill"]["lines"]}["interruptions (expected)"] == (
        pytest.approx(lost / 3600 * 1.10)
    )
    assert plan["provenance"]["wall_hours"] == "measured" and plan["provenance"]["params_total"] == "computed"
    assert plan["provenance"]["checkpointing.write_s"] == "measured"
    assumed = make_plan(load_config(CONFIGS / "x1-lab00.toml"))
    assert assumed["provenance"]["wall_hours"] == "assumed"
    assert assumed["provenance"]["checkpointing.write_s"] == "assumed"


def test_target_loss_plans_the_tokens_the_law_says_and_ranks_instances_by_their_cost(run_cli, tmp_path):
    from pretrainer.analysis.scaling.fit import PUBLISHED_LAW, predict_loss, tokens_for_loss

    n, d = 88_942_080, 3e9  # the inverse of the law: the tokens back from the loss they give
    assert tokens_for_loss(PUBLISHED_LAW, n, float(predict_loss(PUBLISHED_LAW, n, d))) == pytest.approx(d)
    assert math.isnan(tokens_for_loss(PUBLISHED_LAW, n, 1.9))  # below this size's floor
    target = float(predict_loss(PUBLISHED_LAW, n, 4e9))
    code, out, err = run_cli(
        "plan", CONFIGS / "x1-lab00.toml", "--target-loss", str(target), "--compare", "--json"
    )
    assert code == 0, err
    plan = json.loads(out)
    assert (
        plan["target_loss"]["tokens"] == pytest.approx(4e9, rel=1e-6)
        and "Hoffmann" in plan["target_loss"]["law"]
    )
    assert plan["steps"] == math.ceil(plan["target_loss"]["tokens"] / 524_288)
    costs = [row["total_usd"] for row in plan["compare"] if row["fits"]]
    assert costs == sorted(costs)  # ranked by what reaching the loss costs
    code, _, err = run_cli("plan", CONFIGS / "x1-lab00.toml", "--target-loss", "1.9")
    assert code == 2 and "floor" in err and len(err.strip().splitlines()) == 1


def test_the_go_no_go_line_names_its_real_reason():
    """NO-GO because of the cap read "NO-GO: $1.1/GPU-hour against a limit of $1.40"."""
    from pretrainer.analysis.costs import format_bill

    bill = {"lines": [], "cap_usd": 10.0, "total_usd": 12.0, "max_usd_per_gpu_hour": 1.4, "max_source": "lab"}
    said = lambda price, go: dict(format_bill({**bill, "go": go}, price))["go/no-go"]  # noqa: E731
    assert said(1.1, False).startswith("NO-GO: the total $12.00 is over the $10.00 cap")
    assert said(2.0, False).startswith("NO-GO: the price is over the limit: $2/GPU-hour")
    assert said(1.1, True).startswith("GO: $1.1/GPU-hour against a limit of $1.40")


def test_plan_on_a_cpu_config_points_at_measure_and_counts_no_cuda_context(run_cli):
    code, out, err = run_cli("plan", "configs/tiny-cpu.toml", "--train.device=cpu", "--model.vocab_size=4096")
    assert code == 0, err
    assert "plan --measure times a few real steps on this machine" in out and "CUDA context" not in out
