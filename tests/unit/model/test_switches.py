"""model.qkv_bias and model.dropout: the DDP story's GPT-2 (no q/k/v biases, dropout 0.1)."""

import pytest
import torch

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
