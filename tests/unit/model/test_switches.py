"""model.qkv_bias and model.dropout: the DDP story's GPT-2 (no q/k/v biases, dropout 0.1)."""

import pytest
import torch
from helpers import DOCS

from pretrainer.config.load import load_config
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer

SHAPE = dict(vocab_size=97, seq_len=32, d_model=32, n_layer=2, n_head=4)


def biases(model: Transformer) -> set[str]:
    return {name.split(".")[-2] for name, _ in model.named_parameters() if name.endswith("_proj.bias")}


def test_qkv_bias_switches_the_query_key_value_biases_only():
    gpt2 = Transformer(ModelConfig(arch="gpt2", **SHAPE))
    bare = Transformer(ModelConfig(arch="gpt2", qkv_bias="false", **SHAPE))
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= biases(gpt2)
    assert "o_proj" in biases(bare) and not {"q_proj", "k_proj", "v_proj"} & biases(bare)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(gpt2) - count(bare) == 3 * 32 * 2  # three d_model biases per layer
    llama = Transformer(ModelConfig(arch="llama", qkv_bias="true", **SHAPE))
    assert biases(llama) == {"q_proj", "k_proj", "v_proj"}
    assert load_config(None, ["--model.qkv_bias=no"]).model.qkv_bias == "false"  # a switch's words


def test_dropout_is_random_while_training_and_absent_in_evaluation():
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(arch="gpt2", **SHAPE))
    dropped = Transformer(ModelConfig(arch="gpt2", dropout=0.1, **SHAPE))
    dropped.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        plain.eval(), dropped.eval()
        assert torch.equal(plain(idx)[0], dropped(idx)[0])  # evaluation and sampling see no dropout
        dropped.train()
        first, second = dropped(idx)[0], dropped(idx)[0]
        torch.manual_seed(7)
        again = dropped(idx)[0]
        torch.manual_seed(7)
        assert not torch.equal(first, second) and torch.equal(again, dropped(idx)[0])  # seeded: resumable
    with pytest.raises(UserError, match="model.dropout"):  # attention probabilities: [0, 1)
        load_config(None, ["--model.dropout=1.0"])
    with pytest.raises(UserError, match="flex"):
        load_config(None, ["--model.dropout=0.1", "--data.packing=document"])


@pytest.mark.parametrize(
    "switch", [{"qk_norm": "true"}, {"mlp": "relu2"}, {"qk_norm": "true", "mlp": "relu2"}]
)
def test_nanochat_s_qk_norm_and_relu2_compute_what_they_say_and_export_only_as_qwen3(switch, tmp_path):
    """model.qk_norm and model.mlp = relu2 (the nanochat ablations): the module does the formula, a KV
    cache decodes what the full forward computes; QK-norm alone exports (Qwen3: tests/unit/artifacts),
    and with ReLU² both exports refuse in one line with no file."""
    import torch.nn.functional as F

    from pretrainer.artifacts.checkpoint import model_weights
    from pretrainer.artifacts.gguf_format import export_gguf
    from pretrainer.artifacts.hf_format import export_hf
    from pretrainer.config.resolve import model_shape
    from pretrainer.data.tokenizers.bpe import train_bpe
    from pretrainer.model.transformer import KVCache

    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", **{**SHAPE, "vocab_size": 384}, **switch)
    model = Transformer(cfg).eval()
    block, x = model.layers[0], torch.randn(2, 5, 32)
    if switch.get("mlp") == "relu2":
        assert not hasattr(block.mlp, "gate_proj") and block.mlp.up_proj.out_features == 4 * 32
        expected = block.mlp.down_proj(F.relu(block.mlp.up_proj(x)) ** 2)
        assert torch.allclose(block.mlp(x), expected)
    if switch.get("qk_norm"):  # unit-RMS queries and keys: a scaled input scales only the values
        rope = (model.rope_cos[:5], model.rope_sin[:5])
        assert torch.allclose(3 * block.attn(x, rope, None), block.attn(3 * x, rope, None), atol=1e-4)
    plain = ModelConfig(arch="llama", **{**SHAPE, "vocab_size": 384}, qk_norm="false")
    assert model_shape(cfg) != model_shape(plain)
    idx = torch.randint(0, 384, (1, 12))
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache(
            n_layer=2, batch=1, n_kv_head=4, max_len=12, head_dim=8, device="cpu", dtype=torch.float32
        )
        stepped = torch.cat([model(idx[:, :8], kv_cache=cache)[0]] + [
            model(idx[:, i : i + 1], kv_cache=cache)[0] for i in range(8, 12)
        ], dim=1)  # fmt: skip
    assert torch.allclose(full, stepped, atol=1e-5)
    tokenizer = train_bpe(iter(DOCS), 300)
    for export in (export_hf, export_gguf):
        out = tmp_path / export.__name__
        if "mlp" not in switch:
            export(cfg, model_weights(model), tokenizer, out)
            assert out.exists()
            continue
        with pytest.raises(UserError, match="not exported") as refused:
            export(cfg, model_weights(model), tokenizer, out)
        assert "\n" not in str(refused.value) and not out.exists()
