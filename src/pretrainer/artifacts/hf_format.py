"""Hugging Face interop: export to / import from `transformers` checkpoint directories.

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
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrainer.config.resolve import resolve_d_ff, uses_qk_norm
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_directory, save_safetensors
from pretrainer.core.streams import weights_bar
from pretrainer.data.tokenizers.bpe import hf_tokenizer_files

# --- weights ---

_LLAMA = [  # (ours, theirs) for per-layer tensors; {i} is the layer index
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
_LLAMA_GLOBAL = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]

_GPT2 = [  # (ours, theirs, transposed)
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
_GPT2_GLOBAL = [
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
        for mine, theirs in _LLAMA_GLOBAL:
            if mine in ours:
                out[theirs] = ours[mine]
        for i in range(cfg.n_layer):
            for mine, theirs in _LLAMA:
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
    for mine, theirs in _GPT2_GLOBAL:
        out[theirs] = ours[mine]
    for i in range(cfg.n_layer):
        for mine, theirs, transposed in _GPT2:
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
        for mine, hf_key in _LLAMA_GLOBAL:
            if hf_key == "lm_head.weight" and cfg.tie_embeddings:
                normalised.pop(hf_key, None)
                continue
            ours[mine] = take(hf_key)
        for i in range(cfg.n_layer):
            for mine, hf_key in _LLAMA:
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
        for mine, hf_key in _GPT2_GLOBAL:
            ours[mine] = take(hf_key)
        for i in range(cfg.n_layer):
            for mine, hf_key, transposed in _GPT2:
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
