"""Hugging Face interop, the export: our models as `transformers` checkpoint directories (the import of
one, and the shared name tables read backwards: hf_import.py).

Export writes what `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
load offline: config.json (LlamaForCausalLM, Qwen3ForCausalLM for a llama with model.qk_norm, or
GPT2LMHeadModel), model.safetensors with Hugging
Face parameter names, tokenizer.json (a `tokenizers` byte-level BPE with exactly our merges; an hf:
tokenizer's own file, unchanged) and tokenizer_config.json. Nothing here needs `transformers` itself;
the tokenizer needs `tokenizers`.

Name mapping (ours -> Hugging Face):
  llama: wte -> model.embed_tokens, layers.i.attn.{q,k,v,o}_proj -> model.layers.i.self_attn.*,
         layers.i.mlp.* -> model.layers.i.mlp.*, attn_norm -> input_layernorm,
         mlp_norm -> post_attention_layernorm, norm -> model.norm, lm_head -> lm_head
  qwen3: llama's names, plus self_attn.{q,k}_norm: our QK-norm has no gains, so they are ones (and an
         import takes only ones)
  gpt2:  Hugging Face GPT-2 uses Conv1D (weights stored transposed) and one fused c_attn for q, k, v.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pretrainer.config.resolve import resolve_d_ff, uses_qk_norm
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_directory, save_safetensors
from pretrainer.core.streams import weights_bar
from pretrainer.data.tokenizers.bpe import hf_tokenizer_files

# --- weights ---

LLAMA_LAYER_NAMES = [  # (ours, theirs) for per-layer tensors; {i} is the layer index
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
]
LLAMA_GLOBAL_NAMES = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]

GPT2_LAYER_NAMES = [  # (ours, theirs, transposed)
    ("layers.{i}.attn_norm.weight", "transformer.h.{i}.ln_1.weight", False),
    ("layers.{i}.attn_norm.bias", "transformer.h.{i}.ln_1.bias", False),
    ("layers.{i}.attn.o_proj.weight", "transformer.h.{i}.attn.c_proj.weight", True),
    ("layers.{i}.attn.o_proj.bias", "transformer.h.{i}.attn.c_proj.bias", False),
    ("layers.{i}.mlp_norm.weight", "transformer.h.{i}.ln_2.weight", False),
    ("layers.{i}.mlp_norm.bias", "transformer.h.{i}.ln_2.bias", False),
    ("layers.{i}.mlp.up_proj.weight", "transformer.h.{i}.mlp.c_fc.weight", True),
    ("layers.{i}.mlp.up_proj.bias", "transformer.h.{i}.mlp.c_fc.bias", False),
    ("layers.{i}.mlp.down_proj.weight", "transformer.h.{i}.mlp.c_proj.weight", True),
    ("layers.{i}.mlp.down_proj.bias", "transformer.h.{i}.mlp.c_proj.bias", False),
]
GPT2_GLOBAL_NAMES = [
    ("wte.weight", "transformer.wte.weight"),
    ("wpe.weight", "transformer.wpe.weight"),
    ("norm.weight", "transformer.ln_f.weight"),
    ("norm.bias", "transformer.ln_f.bias"),
]


def is_qwen3(cfg: ModelConfig) -> bool:
    """A llama with QK-norm is Hugging Face's (and llama.cpp's) Qwen3: the same blocks, q and k RMS-normed
    per head before RoPE."""
    return cfg.arch == "llama" and uses_qk_norm(cfg)


def to_hf_weights(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (tied aliases already left out) -> Hugging Face names and layouts."""
    out = {}
    switches = [
        name
        for name, on in (("a gpt2 with model.qk_norm", uses_qk_norm(cfg) and cfg.arch == "gpt2"),
                         ("model.mlp = relu2", cfg.mlp == "relu2"))
        if on
    ]  # fmt: skip
    if switches:  # GGUF maps through these names too: one refusal for both
        raise UserError(
            f"{' and '.join(switches)}: neither Hugging Face's Llama/Qwen3/GPT-2 nor llama.cpp computes it, "
            "so this model is not exported; pretrainer's own sample, chat, eval and serve-cost run it"
        )
    if cfg.arch == "llama" and cfg.qkv_bias == "true":
        raise UserError(
            "Hugging Face Llama's attention_bias puts a bias on the output projection too; export a llama "
            "model trained with model.qkv_bias = auto or false"
        )
    if cfg.arch == "llama":
        for mine, theirs in LLAMA_GLOBAL_NAMES:
            if mine in ours:
                out[theirs] = ours[mine]
        for i in range(cfg.n_layer):
            for mine, theirs in LLAMA_LAYER_NAMES:
                out[theirs.format(i=i)] = ours[mine.format(i=i)]
            if is_qwen3(cfg):
                gains = torch.ones(cfg.d_model // cfg.n_head, dtype=out["model.embed_tokens.weight"].dtype)
                for part in "qk":
                    out[f"model.layers.{i}.self_attn.{part}_norm.weight"] = gains.clone()
        return out
    if not cfg.tie_embeddings:
        raise UserError(
            "Hugging Face GPT-2 ties its embeddings; export a gpt2 model trained with model.tie_embeddings = "
            "true"
        )
    for mine, theirs in GPT2_GLOBAL_NAMES:
        out[theirs] = ours[mine]
    for i in range(cfg.n_layer):
        for mine, theirs, transposed in GPT2_LAYER_NAMES:
            tensor = ours[mine.format(i=i)]
            out[theirs.format(i=i)] = tensor.t().contiguous() if transposed else tensor
        qkv = [ours[f"layers.{i}.attn.{p}_proj.weight"] for p in "qkv"]
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(qkv, dim=0).t().contiguous()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(  # model.qkv_bias = false: HF's are zeros
            [
                ours.get(f"layers.{i}.attn.{p}_proj.bias", torch.zeros(w.size(0), dtype=w.dtype))
                for p, w in zip("qkv", qkv)
            ]
        )
    return out


# --- configs ---


def hf_config(cfg: ModelConfig, eot_id: int, dtype: str = "float32", bos_id: int | None = None) -> dict:
    """bos_id: the tokenizer's BOS when documents start with one (hf: tokenizers such as Llama-3's), else
    end-of-text."""
    common = {
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eot_id if bos_id is None else bos_id,
        "eos_token_id": eot_id,
        "torch_dtype": dtype,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if cfg.arch == "llama":
        qwen3 = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer}
        return {
            "architectures": ["Qwen3ForCausalLM" if is_qwen3(cfg) else "LlamaForCausalLM"],
            "model_type": "qwen3" if is_qwen3(cfg) else "llama",
            **common,
            "hidden_size": cfg.d_model,
            "intermediate_size": resolve_d_ff(cfg),
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
            "head_dim": cfg.d_model // cfg.n_head,
            "max_position_embeddings": cfg.seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            **({} if is_qwen3(cfg) else {"mlp_bias": False}),
            "attention_dropout": 0.0,
            **(qwen3 if is_qwen3(cfg) else {}),
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **common,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_positions": cfg.seq_len,
        "n_ctx": cfg.seq_len,
        "n_inner": resolve_d_ff(cfg),
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


# --- export ---

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def without_padding_rows(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], vocab_in_use: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model as its tokenizer sees it: the embedding's and output projection's rows above the
    tokenizer's vocabulary (padding to a multiple of 128, never an input or a target) dropped, so the
    exported vocab_size is the tokenizer's and no consumer can sample an id it cannot decode."""
    if cfg.vocab_size <= vocab_in_use:
        return cfg, weights
    rows = {"wte.weight", "lm_head.weight"}
    trimmed = {k: v[:vocab_in_use] if k in rows else v for k, v in weights.items()}
    return dataclasses.replace(cfg, vocab_size=vocab_in_use), trimmed


def export_hf(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer,
    out: Path,
    dtype: str = "fp32",
    *,
    kind: str = "hf",
) -> None:
    """`out`: a transformers model directory, marked as a `kind` output (core/ownership.py: "hf", or
    "hub-push" for a push's staging)."""
    torch_dtype = DTYPES[dtype]
    cfg, weights = without_padding_rows(cfg, weights, tokenizer.vocab_size)
    with atomic_directory(Path(out), kind=kind) as tmp:
        theirs, hf_weights = to_hf_weights(cfg, weights), {}
        with weights_bar(theirs, f"export {kind} ({dtype})") as bar:
            for key, tensor in theirs.items():
                hf_weights[key] = tensor.to(torch_dtype).contiguous()
                bar.update(tensor.nelement() * tensor.element_size())
            bar.set_postfix_str("writing model.safetensors")
            save_safetensors(hf_weights, tmp / "model.safetensors", metadata={"format": "pt"})
        config = hf_config(cfg, tokenizer.eot_id, str(torch_dtype).removeprefix("torch."), tokenizer.bos_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        stops = tokenizer.eot_id
        # a chat model ends its turn there (data/tokenizers/chat_format.py)
        if "<|assistant_end|>" in tokenizer.special_tokens:
            stops = [tokenizer.special_tokens["<|assistant_end|>"], tokenizer.eot_id]
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": stops}, indent=2) + "\n"
        )
        hf_tokenizer_files(tokenizer, tmp, model_max_length=cfg.seq_len)
