"""GGUF export read back with gguf's own reader (the package llama.cpp's converter writes with): every
tensor under llama.cpp's name, shape and values, the hyper-parameters, and the tokenizer. That
llama.cpp generates what we do is benchmarks/gguf_llamacpp.py's job (it builds llama.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DOCS
from support.hf_tokenizer_helpers import TEXTS, byte_level_bpe

from pretrainer.artifacts.checkpoint import model_weights
from pretrainer.artifacts.gguf_format import export_gguf
from pretrainer.config.resolve import uses_qk_norm
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.data.tokenizers.base import _bytes_to_unicode
from pretrainer.data.tokenizers.bpe import train_bpe
from pretrainer.data.tokenizers.chat_format import HF_CHAT_TEMPLATE, chat_tokenizer
from pretrainer.data.tokenizers.hf import load_hf_tokenizer
from pretrainer.model import Transformer
from pretrainer.model.transformer import apply_rope, rope_tables

# a core dependency, imported where a GGUF is written: a site image running the cuda tests may lack it
gguf = pytest.importorskip("gguf")

SHAPES = {  # vocab 384: the tokenizer's 300 ids padded to a multiple of 128, as training does
    "llama-gqa-tied": dict(
        arch="llama", vocab_size=384, seq_len=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96,
        rope_theta=500000.0, norm_eps=1e-6, qk_norm="false",
    ),
    "llama-untied": dict(
        arch="llama", vocab_size=384, seq_len=64, d_model=64, n_layer=2, n_head=4, n_kv_head=0,
        tie_embeddings=False, qk_norm="false",
    ),
    "qwen3": dict(  # a llama with QK-norm is llama.cpp's qwen3
        arch="llama", vocab_size=384, seq_len=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2,
        qk_norm="true", rope_theta=100000.0,
    ),
    "gpt2": dict(arch="gpt2", vocab_size=384, seq_len=64, d_model=64, n_layer=2, n_head=4, n_kv_head=0),
}  # fmt: skip

# llama.cpp's tensor names (its models/llama.cpp and models/gpt2.cpp loaders) -> ours; written out here,
# not taken from the export's mapping, so a wrong mapping cannot pass
LLAMA_NAMES = {
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}
GPT2_NAMES = {
    f"blk.{{i}}.{theirs}.{kind}": f"layers.{{i}}.{ours}.{kind}"
    for theirs, ours in [
        ("attn_norm", "attn_norm"),
        ("attn_output", "attn.o_proj"),
        ("ffn_norm", "mlp_norm"),
        ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"),
    ]
    for kind in ("weight", "bias")
}


@pytest.fixture(scope="module")
def bpe():
    """Our own BPE (bpe:N, GPT-4's split pattern), 300 ids."""
    return train_bpe(iter(DOCS + TEXTS), 300)


def export(name: str, tokenizer, path, dtype: str) -> tuple[Transformer, gguf.GGUFReader]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPES[name])).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped pair cannot hide
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if p is model.norm.weight else 0.0, 0.1)
    export_gguf(model.cfg, model_weights(model), tokenizer, path, dtype=dtype)
    return model, gguf.GGUFReader(path)


def expected_tensors(model: Transformer, rows: int) -> dict[str, torch.Tensor]:
    """What llama.cpp should find under each name, in (out, in) layout, except q and k: their rows
    are reordered for llama.cpp's RoPE, checked by test_llama_rope_attention_scores_survive."""
    ours, cfg = model_weights(model), model.cfg
    ours = {k: v[:rows] if k in ("wte.weight", "lm_head.weight") else v for k, v in ours.items()}
    globals_ = {"token_embd.weight": "wte.weight", "output_norm.weight": "norm.weight"}
    if cfg.arch == "gpt2":
        globals_ |= {"position_embd.weight": "wpe.weight", "output_norm.bias": "norm.bias"}
    if not cfg.tie_embeddings:
        globals_["output.weight"] = "lm_head.weight"  # tied: absent, llama.cpp reuses token_embd
    expected = {theirs: ours[mine] for theirs, mine in globals_.items()}
    for i in range(cfg.n_layer):
        for theirs, mine in (LLAMA_NAMES if cfg.arch == "llama" else GPT2_NAMES).items():
            expected[theirs.format(i=i)] = ours[mine.format(i=i)]
        if uses_qk_norm(cfg):  # our QK-norm has no gains: llama.cpp's are ones
            for part in "qk":
                expected[f"blk.{i}.attn_{part}_norm.weight"] = torch.ones(cfg.d_model // cfg.n_head)
        if cfg.arch == "gpt2":
            for kind in ("weight", "bias"):
                parts = [ours[f"layers.{i}.attn.{p}_proj.{kind}"] for p in "qkv"]
                expected[f"blk.{i}.attn_qkv.{kind}"] = torch.cat(parts)
    return expected


def values(tensor) -> np.ndarray:
    """A tensor of the file as float32, in numpy (row-major) shape."""
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("name", SHAPES)
def test_every_tensor_is_there_with_its_shape_and_values(name, dtype, bpe, tmp_path):
    model, reader = export(name, bpe, tmp_path / "model.gguf", dtype)
    expected = expected_tensors(model, bpe.vocab_size)
    found = {t.name: t for t in reader.tensors}
    assert sorted(found) == sorted(expected)
    matrix = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.Q8_0
    for tensor_name, ours in expected.items():
        tensor, ours = found[tensor_name], ours.float().numpy()
        stays_f32 = ours.ndim == 1 or tensor_name.startswith("position_embd")
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F32 if stays_f32 else matrix), tensor_name
        theirs = values(tensor)
        assert theirs.shape == ours.shape, tensor_name
        if tensor_name.endswith(("attn_q.weight", "attn_k.weight")) and name != "qwen3":
            continue  # rows reordered for llama's RoPE: the RoPE test checks them (qwen3 rotates as we do)
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(theirs, ours), tensor_name
        elif dtype == "f16":  # ours rounded to f16, bit for bit
            assert np.array_equal(theirs, ours.astype(np.float16).astype(np.float32)), tensor_name
        else:  # q8_0: 32-value blocks, each scaled by its largest |value| / 127
            blocks = np.abs(ours).reshape(-1, 32).max(axis=1, keepdims=True)
            # half a step, and the step itself is stored as f16
            assert (np.abs(theirs - ours).reshape(-1, 32) <= blocks / 127 * 0.6).all(), tensor_name
    cfg = model.cfg
    arch = "qwen3" if name == "qwen3" else cfg.arch
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == (1 if dtype == "f16" else 7)  # MOSTLY_F16, MOSTLY_Q8_0
    hyper = {key: field(reader, f"{arch}.{key}") for key in [
        "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "vocab_size",
    ]}  # fmt: skip
    d_ff = 96 if name == "llama-gqa-tied" else 256 if arch == "gpt2" else 192
    assert hyper == {
        "context_length": 64,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": d_ff,
        "attention.head_count": 4,
        "attention.head_count_kv": cfg.n_kv_head or 4,
        "vocab_size": 300,
    }
    if arch != "gpt2":
        assert field(reader, f"{arch}.rope.freq_base") == cfg.rope_theta
        assert field(reader, f"{arch}.rope.dimension_count") == 16
        assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    else:
        assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(cfg.norm_eps)


def llama_cpp_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's RoPE for arch llama (ggml's 'normal' mode): dimensions 2i and 2i + 1 rotate together,
    by position * theta^(-2i / head_dim). x: (T, heads, head_dim)."""
    half = x.size(-1) // 2
    angles = positions[:, None].float() * theta ** (-torch.arange(half) * 2 / x.size(-1))[None, :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def test_llama_rope_attention_scores_survive(bpe, tmp_path):
    """q and k rows in llama.cpp's order: its RoPE on them gives the attention scores ours gives (the
    f16 weights on both sides, so the only difference left would be a wrong order)."""
    model, reader = export("llama-gqa-tied", bpe, tmp_path / "model.gguf", "f16")
    cfg, found = model.cfg, {t.name: t for t in reader.tensors}
    heads, kv_heads, head_dim = cfg.n_head, cfg.n_kv_head, cfg.d_model // cfg.n_head
    x, positions = torch.randn(5, cfg.d_model), torch.tensor([0, 1, 7, 30, 63])
    cos, sin = (table[positions][:, None] for table in rope_tables(cfg.seq_len, head_dim, cfg.rope_theta))

    def ours(i: int, part: str, n: int) -> torch.Tensor:
        weight = getattr(model.layers[i].attn, f"{part}_proj").weight.detach().half().float()
        return apply_rope((x @ weight.T).view(5, n, head_dim), cos, sin)

    def theirs(i: int, part: str, n: int) -> torch.Tensor:
        weight = torch.from_numpy(values(found[f"blk.{i}.attn_{part}.weight"]))
        return llama_cpp_rope((x @ weight.T).view(5, n, head_dim), positions, cfg.rope_theta)

    for i in range(cfg.n_layer):
        group = heads // kv_heads  # query head h reads key head h // group
        scores = [
            torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1))
            for q, k in [
                (ours(i, "q", heads), ours(i, "k", kv_heads)),
                (theirs(i, "q", heads), theirs(i, "k", kv_heads)),
            ]
        ]
        assert torch.allclose(scores[1], scores[0], rtol=1e-5, atol=1e-6), (scores[1] - scores[0]).abs().max()


def gguf_decode(reader: gguf.GGUFReader, ids: list[int]) -> str:
    """Token ids -> text through the file's token list alone (byte-level strings -> bytes)."""
    to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
    types = field(reader, "tokenizer.ggml.token_type")
    pieces = []
    for i in ids:
        token = field(reader, "tokenizer.ggml.tokens")[i]
        control = types[i] == gguf.TokenType.CONTROL
        pieces.append(token.encode() if control else bytes(to_byte[c] for c in token))
    return b"".join(pieces).decode("utf-8", errors="replace")


def test_our_bpe_round_trips_through_the_token_list(bpe, tmp_path):
    _, reader = export("gpt2", bpe, tmp_path / "model.gguf", "f16")
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "llama-bpe"  # GPT-4's split = Llama-3's
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == bpe.vocab_size == 300
    for text in TEXTS + DOCS[:3]:
        ids = bpe.encode(text) + [bpe.eot_id]
        assert gguf_decode(reader, ids) == bpe.decode(ids)
    merges = field(reader, "tokenizer.ggml.merges")
    assert len(merges) == 300 - 256 - 1  # every token beyond the bytes and end-of-text is one merge
    assert all("".join(merge.split(" ")) in tokens for merge in merges)
    assert tokens[bpe.eot_id] == "<|endoftext|>"
    assert field(reader, "tokenizer.ggml.token_type")[bpe.eot_id] == gguf.TokenType.CONTROL
    assert field(reader, "tokenizer.ggml.eos_token_id") == bpe.eot_id
    assert field(reader, "tokenizer.ggml.add_bos_token") is False  # our documents start bare
    assert "tokenizer.chat_template" not in reader.fields


def test_chat_tokenizer_carries_its_template_and_turn_end(bpe, tmp_path):
    chat = chat_tokenizer(bpe)
    _, reader = export("llama-gqa-tied", chat, tmp_path / "model.gguf", "q8_0")  # 307 ids < 384 rows
    assert field(reader, "tokenizer.chat_template") == HF_CHAT_TEMPLATE
    assert field(reader, "tokenizer.ggml.eos_token_id") == chat.special_tokens["<|assistant_end|>"]
    types = field(reader, "tokenizer.ggml.token_type")
    assert all(types[i] == gguf.TokenType.CONTROL for i in chat.special_tokens.values())
    assert (
        field(reader, "llama.vocab_size")
        == len(field(reader, "tokenizer.ggml.tokens"))
        == chat.vocab_size
        == 307
    )


def test_hf_tokenizer_with_gpt2_split_and_a_bos(tmp_path):
    """An hf: byte-level BPE (ByteLevel's own split: GPT-2's regex) whose documents start with BOS."""
    tokenizer = load_hf_tokenizer(f"hf:{byte_level_bpe(tmp_path / 'tok', vocab_size=300)}")
    _, reader = export("llama-untied", tokenizer, tmp_path / "model.gguf", "f16")
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.ggml.bos_token_id") == tokenizer.bos_id
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert gguf_decode(reader, ids) == tokenizer.decode(ids)


def test_refusals_leave_no_file(bpe, tmp_path):
    """A tokenizer llama.cpp would split differently, a model the mapping does not take, a dtype
    GGUF export does not write: one error each, and no file, not even a partial one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    metaspace = Tokenizer(models.BPE(vocab={"a": 0, "<|endoftext|>": 1}, merges=[]))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "sp").mkdir()
    metaspace.save(str(tmp_path / "sp" / "tokenizer.json"))
    model = Transformer(ModelConfig(**SHAPES["gpt2"]))
    untied_gpt2 = Transformer(ModelConfig(**SHAPES["gpt2"], tie_embeddings=False))
    cases = [
        (model, load_hf_tokenizer(f"hf:{tmp_path / 'sp'}"), "f16", "byte-level BPE"),
        (untied_gpt2, bpe, "f16", "model.tie_embeddings = true"),
        (model, bpe, "q4_0", "a GGUF export is f16 or q8_0"),
        # what llama.cpp does not compute: nanochat's ReLU² MLP, QK-norm on a gpt2
        (Transformer(ModelConfig(**SHAPES["qwen3"], mlp="relu2")), bpe, "f16", "model.mlp = relu2"),
        (Transformer(ModelConfig(**SHAPES["gpt2"], qk_norm="true")), bpe, "f16", "a gpt2 with model.qk_norm"),
    ]
    for model, tokenizer, dtype, message in cases:
        with pytest.raises(UserError, match=message):
            export_gguf(model.cfg, model_weights(model), tokenizer, tmp_path / "model.gguf", dtype=dtype)
        assert list(tmp_path.glob("*.gguf*")) == [] and not list(tmp_path.glob(".model.gguf*"))


def test_a_write_that_fails_leaves_the_old_file(bpe, tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"GGUF the previous export")

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match=str(out)):  # the one line names the file
        export("gpt2", bpe, out, "f16")
    assert out.read_bytes() == b"GGUF the previous export" and sorted(tmp_path.iterdir()) == [out]
