"""The user stories' recipes as configs: each plans, and the plan column of its header is what plan says."""

import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

# config, plan's arguments as its header gives them
RECIPES = {
    "x1-lab00.toml": [],
    "x1-50m.toml": [],
    "gpt2-163m-ddp.toml": ["--gpus", "8"],
    "llama3-1b.toml": ["--gpus", "8", "--mfu", "0.397", "--usd-per-gpu-hour", "2.99"],
    "chat-500m-1-pretrain.toml": ["--gpus", "4", "--mfu", "0.0476"],
    "chat-500m-2-midtrain.toml": ["--gpus", "4", "--mfu", "0.0476"],
    "chat-500m-3-sft.toml": ["--gpus", "4", "--mfu", "0.0476"],
}


def header(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_plans_and_its_header_quotes_the_plan(name, run_cli):
    code, out, err = run_cli("plan", CONFIGS / name, *RECIPES[name], "--json")
    assert code == 0, err
    plan, text = json.loads(out), header(CONFIGS / name)
    assert "plan" in text and ("story" in text or "lab" in text or "notes" in text)  # both columns
    assert f"{plan['tokens_trained']:,}" in text
    assert f"{plan['wall_hours']:.2f} h" in text
    if "bill" in plan:
        assert f"${plan['bill']['total_usd']:,.2f}" in text or f"${plan['cost_usd']:,.2f}" in text


def test_the_lab_as_written_is_no_go_and_our_version_is_go(run_cli):
    lab = json.loads(run_cli("plan", CONFIGS / "x1-lab00.toml", "--json")[1])
    ours = json.loads(run_cli("plan", CONFIGS / "x1-50m.toml", "--json")[1])
    assert lab["params_total"] == ours["params_total"] == 88_942_080
    assert lab["tokens_trained"] == 84_000 * 524_288  # the lab's steps: 44B tokens, not its "~5B"
    assert not lab["bill"]["go"] and ours["bill"]["go"]


def test_the_scaling_triple_dry_run_is_the_header(run_cli):
    code, out, err = run_cli("sweep", CONFIGS / "x1-scaling.toml", "--dry-run")
    assert code == 0, err
    total = out.strip().splitlines()[-1]  # "total: ... FLOPs, $X at ..."
    assert total.split("$")[1].split()[0] in header(CONFIGS / "x1-scaling.toml")
    hours = [line.split()[-2] for line in out.splitlines() if line.startswith("l")]
    assert len(hours) == 3 and all(h.replace("h", " h") in header(CONFIGS / "x1-scaling.toml") for h in hours)
