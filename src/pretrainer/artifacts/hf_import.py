"""Hugging Face interop, the import: a local `transformers` Llama, Qwen3 or GPT-2 directory as our model
config and weights (`--init.from=hf:DIR`, `eval hf:DIR`), or one error listing every setting our model
would not reproduce exactly. The names are hf_format.py's tables, read backwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrainer.artifacts.hf_format import (
    GPT2_GLOBAL_NAMES,
    GPT2_LAYER_NAMES,
    LLAMA_GLOBAL_NAMES,
    LLAMA_LAYER_NAMES,
    is_qwen3,
)
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError


def from_hf_weights(cfg: ModelConfig, theirs: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts -> ours. Accepts base-model keys (no model./transformer. prefix)."""
    prefix = "model." if cfg.arch == "llama" else "transformer."
    normalised = {}
    for key, tensor in theirs.items():
        if cfg.arch == "gpt2" and re.search(r"\.attn\.(bias|masked_bias)$", key):
            continue  # old GPT-2 checkpoints store the causal mask as a buffer
        normalised[key if key.startswith(prefix) or key == "lm_head.weight" else prefix + key] = tensor

    def take(key: str) -> torch.Tensor:
        if key not in normalised:
            raise UserError(
                f"{where}: no tensor '{key}' in the Hugging Face weights; is this a {cfg.arch} checkpoint?"
            )
        return normalised.pop(key)

    ours = {}
    if cfg.arch == "llama":
        for mine, hf_key in LLAMA_GLOBAL_NAMES:
            if hf_key == "lm_head.weight" and cfg.tie_embeddings:
                normalised.pop(hf_key, None)
                continue
            ours[mine] = take(hf_key)
        for i in range(cfg.n_layer):
            for mine, hf_key in LLAMA_LAYER_NAMES:
                ours[mine.format(i=i)] = take(hf_key.format(i=i))
            if is_qwen3(cfg):
                for part in "qk":
                    gains = take(f"model.layers.{i}.self_attn.{part}_norm.weight")
                    if not torch.all(gains == 1):
                        raise UserError(
                            f"{where}: layer {i}'s {part}_norm has learned gains; pretrainer's QK-norm has "
                            f"none, so these weights cannot be imported exactly"
                        )
    else:
        normalised.pop("lm_head.weight", None)  # tied to wte
        for mine, hf_key in GPT2_GLOBAL_NAMES:
            ours[mine] = take(hf_key)
        for i in range(cfg.n_layer):
            for mine, hf_key, transposed in GPT2_LAYER_NAMES:
                tensor = take(hf_key.format(i=i))
                ours[mine.format(i=i)] = tensor.t().contiguous() if transposed else tensor
            weight, bias = (
                take(f"transformer.h.{i}.attn.c_attn.weight").t(),
                take(f"transformer.h.{i}.attn.c_attn.bias"),
            )
            for part, w, b in zip("qkv", weight.chunk(3, dim=0), bias.chunk(3)):
                ours[f"layers.{i}.attn.{part}_proj.weight"] = w.contiguous()
                if cfg.qkv_bias != "false":
                    ours[f"layers.{i}.attn.{part}_proj.bias"] = b.contiguous()
                elif b.any():
                    raise UserError(
                        f"{where}: layer {i}'s {part} bias is not zero, but model.qkv_bias = false"
                    )
    if normalised:
        raise UserError(
            f"{where}: Hugging Face weights have tensors this model does not: "
            f"{', '.join(sorted(normalised)[:5])}"
        )
    return ours


def unsupported(hf: dict) -> list[str]:
    """Every setting of a Hugging Face config that pretrainer's model would not reproduce exactly."""
    kind, problems = hf.get("model_type"), []
    if kind in ("llama", "qwen3"):
        for key in ("rope_scaling", "rope_parameters"):
            scaling = hf.get(key) or {}
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # older configs say "type"
            if rope_type != "default":
                problems.append(f"RoPE scaling '{rope_type}' ({key}) is not supported")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers maps both to SiLU
            problems.append(
                f"hidden_act '{hf['hidden_act']}' is not supported (the llama MLP is SwiGLU with silu)"
            )
        hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
        # null: the default (Qwen3's is 128, Llama's hidden / heads)
        if hidden and heads:
            head_dim = hf.get("head_dim") or (128 if kind == "qwen3" else hidden // heads)
            if head_dim != hidden // heads:
                problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads is not supported")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            problems.append("biases (attention_bias / mlp_bias) are not supported")
        if kind == "qwen3" and hf.get("use_sliding_window"):
            problems.append("sliding-window attention (use_sliding_window = true) is not supported")
    elif kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            problems.append(
                f"activation_function '{hf['activation_function']}' is not supported (gelu_new only)"
            )
        if hf.get("tie_word_embeddings", True) is False:
            problems.append("an untied lm_head (tie_word_embeddings = false) is not supported for gpt2")
        if hf.get("scale_attn_by_inverse_layer_idx", False):
            problems.append("scale_attn_by_inverse_layer_idx = true is not supported")
        if hf.get("scale_attn_weights", True) is False:
            problems.append("scale_attn_weights = false (unscaled attention) is not supported")
    return problems


# the sizes of a Hugging Face config that must be positive integers (null: the default)
SIZE_KEYS = {
    "llama": (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
    ),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner"),
}
SIZE_KEYS["qwen3"] = SIZE_KEYS["llama"]


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """Our model config for a Hugging Face llama or gpt2 config; one error listing every setting it
    would not reproduce exactly (rather than an import whose logits silently differ)."""
    kind = hf.get("model_type")
    if kind not in ("llama", "qwen3", "gpt2"):
        raise UserError(
            f"{where}: model_type '{kind}' is not supported; pretrainer imports llama, qwen3 and gpt2"
        )
    problems = unsupported(hf)
    if problems:
        raise UserError(f"{where}: cannot import exactly: {'; '.join(problems)}")
    for key in SIZE_KEYS[kind]:  # "vocab_size": "big" was a traceback deep in the config's checks
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{where}: {key} must be a positive integer, not {str(value)[:40]!r}; fix it")
    try:
        if kind in ("llama", "qwen3"):
            rope = hf.get("rope_parameters") or {}
            hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
            return ModelConfig(
                arch="llama",
                vocab_size=hf["vocab_size"],
                seq_len=hf.get("max_position_embeddings", 2048),
                d_model=hidden,
                n_layer=hf["num_hidden_layers"],
                n_head=heads,
                n_kv_head=hf.get("num_key_value_heads") or heads,
                d_ff=hf["intermediate_size"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                qk_norm="true" if kind == "qwen3" else "false",
            )
        return ModelConfig(
            arch="gpt2",
            vocab_size=hf["vocab_size"],
            seq_len=hf["n_positions"],
            d_model=hf["n_embd"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            n_kv_head=0,
            d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
            tie_embeddings=True,
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except KeyError as e:
        raise UserError(f"{where}: missing {e} in the Hugging Face config") from None


def read_hf_config(directory: Path) -> ModelConfig:
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise UserError(
            f"{config_path}: not found; --init.from=hf:DIR needs a local Hugging Face model directory"
        )
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{config_path}: not valid JSON ({type(e).__name__}); fix or replace it") from None
    if not isinstance(hf, dict):
        raise UserError(f"{config_path}: not a JSON object; fix or replace it")
    return model_config_from_hf(hf, str(config_path))


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 weights of a local model directory (safetensors, sharded, or .bin)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():
        weights = load_file(directory / "model.safetensors")
    elif index.is_file():
        weights = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            weights.update(load_file(directory / shard))
    elif (directory / "pytorch_model.bin").is_file():
        weights = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{directory}: no model.safetensors, sharded safetensors index or pytorch_model.bin")
    return {k: v.float() for k, v in weights.items()}
