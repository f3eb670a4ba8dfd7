import json
import math
from pathlib import Path

import pytest

from pretrainer.config import load_config
from pretrainer.errors import UserError
from pretrainer.plan import make_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_plan_cli_prints_the_published_llama3_1b_count(run_cli):
    code, out, _ = run_cli("plan", CONFIGS / "llama3-1b.toml")
    assert code == 0 and "1,241,581,568" in out


@pytest.mark.parametrize("name, total, non_embedding", [
    ("gpt2-124m.toml", 124_439_808, 124_439_808 - 50257 * 768 - 1024 * 768),
    ("x1-50m.toml", 88_942_080, 50_344_704),
    ("llama3-1b.toml", 1_241_581_568, 1_241_581_568 - 131072 * 2048),
])
def test_seed_configs_have_their_published_sizes(name, total, non_embedding):
    plan = make_plan(load_config(CONFIGS / name))
    assert plan["params_total"] == total and plan["params_non_embedding"] == non_embedding


def test_gpt2_flops_tokens_and_steps_by_hand(run_cli):
    plan = make_plan(load_config(CONFIGS / "gpt2-124m.toml"), tokens=10e9, gpus=8)
    non_embedding = 124_439_808 - 50257 * 768 - 1024 * 768
    n_matmul = non_embedding + 50257 * 768  # the tied output projection is still a matmul
    attention = 12 * 12 * 12 * 64 * 1024  # 12 * n_layer * n_head * head_dim * seq_len
    assert plan["flops_per_token"] == 6 * n_matmul + attention == 855_166_464
    assert plan["tokens_per_step"] == 16 * 1024 * 4 * 8 == 524_288
    assert plan["steps_for_budget"] == math.ceil(10e9 / 524_288) == 19_074
    code, out, _ = run_cli("plan", CONFIGS / "gpt2-124m.toml", "--tokens", "10e9", "--gpus", "8", "--json")
    assert code == 0 and json.loads(out)["steps_for_budget"] == 19_074


def test_chinchilla_default_and_overrides(run_cli):
    plan = make_plan(load_config(CONFIGS / "x1-50m.toml", ["--train.grad_accum=8"]))
    assert plan["token_budget"] == 20 * 88_942_080
    assert plan["tokens_per_step"] == 32 * 1024 * 8
    code, out, _ = run_cli("plan", CONFIGS / "x1-50m.toml", "--tokens-per-param", "100", "--model.n_layer=4")
    assert code == 0 and "100 tokens per parameter" in out


def test_plan_needs_a_vocab():
    with pytest.raises(UserError, match="model.vocab_size is 0"):
        make_plan(load_config(None))
