"""GGUF export: the model and its tokenizer as one file that llama.cpp loads (`export --format gguf`).

Written with the `gguf` package (llama.cpp's own reader and writer). The file is what llama.cpp's
convert_hf_to_gguf.py would make of our Hugging Face export (hf_format.py), without going through one:

  names    ours -> Hugging Face (hf_format.to_hf_weights) -> GGUF (gguf's TensorNameMap), so both
           model families (arch "llama", arch "gpt2") take the mapping the hf export is tested with
  llama    q and k rows permuted from the rotate-half RoPE layout (ours, Hugging Face's) to the
           adjacent pairs llama.cpp rotates (convert_hf_to_gguf's LlamaModel.permute)
  qwen3    a llama with model.qk_norm: llama.cpp's qwen3 arch, which norms q and k per head (attn_q_norm,
           attn_k_norm: ones) and rotates in the rotate-half layout, so q and k are not permuted
  gpt2     Hugging Face's Conv1D weights transposed back to (out, in); q, k, v fused as attn_qkv
  tied     no output.weight: llama.cpp then multiplies by token_embd, as for a tied HF checkpoint
  dtypes   f16 or q8_0 for matrices; norms, biases, every 1-D tensor and gpt2's position embedding
           stay f32 (convert_hf_to_gguf's rule); a matrix whose rows q8_0 cannot cut into blocks of 32
           falls back to f16 as it does there
  vocab    the tokenizer's size: the rows padding the vocabulary to a multiple of 128 are dropped
           (hf_format.without_padding_rows), so the token list and the embedding agree

The tokenizer is llama.cpp's byte-level BPE ("gpt2" model), read from the Hugging Face files the hf
export writes (every kind: gpt2, bpe:N, hf:): the tokens and their types, the merges, end-of-text
as EOS, the BOS llama.cpp puts first only where our documents start with one (hf: tokenizers such as
Llama-3's), and the chat template for a chat tokenizer (data/tokenizers/chat_format.py).
`tokenizer.ggml.pre` names the pre-tokenizer llama.cpp splits text with; only split patterns that
llama.cpp reproduces are exported (PRE_TOKENIZERS): GPT-2's (gpt2 and hf: GPT-2-style tokenizers)
and the GPT-4 / Llama-3 one (our bpe:N; Llama-3's tokenizer.json spells it differently, same splits).
Anything else is refused rather than written with a pre-tokenizer that splits differently.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from pretrainer.artifacts.hf_format import is_qwen3, to_hf_weights, without_padding_rows
from pretrainer.config.resolve import resolve_d_ff
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_file
from pretrainer.core.ownership import GGUF_MARKER_KEY
from pretrainer.core.streams import weights_bar
from pretrainer.data.tokenizers.bpe import BPE_PATTERN, GPT2_PATTERN, hf_tokenizer_files

DTYPES = ("f16", "q8_0")

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) for the split regexes it reproduces: "gpt-2" runs
# GPT-2's regex, "llama-bpe" Llama-3's, which splits exactly as our bpe:N pattern (GPT-4's): it spells
# the contractions without (?i:) and the possessive quantifiers as plain ones, which match the same
# pieces here, and \s*[\r\n]+ where ours has \s*[\r\n] (both end at a run's last newline).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {GPT2_PATTERN: "gpt-2", BPE_PATTERN: "llama-bpe", LLAMA3_PATTERN: "llama-bpe"}


def export_gguf(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer,
    out: Path,
    *,
    dtype: str = "f16",
    name: str = "pretrainer",
) -> None:
    """Write `out` (atomically: a complete file or none) from our model config, its weights under our
    names and its tokenizer."""
    import gguf

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: a GGUF export is f16 or q8_0")
    cfg, weights = without_padding_rows(cfg, weights, tokenizer.vocab_size)
    tensors = gguf_tensors(cfg, weights)  # before the file: an unsupported model is refused first
    vocabulary = gguf_vocabulary(tokenizer, cfg.seq_len)
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # as the other formats
    with atomic_file(Path(out), kind="gguf") as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf_arch(cfg)])
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        writer.add_string(GGUF_MARKER_KEY, "gguf")  # what `export --force` may replace (core/ownership.py)
        add_hyper_parameters(writer, cfg)
        file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_vocabulary(writer, vocabulary)
        with weights_bar(tensors, f"export gguf ({dtype})") as bar:
            for tensor_name, tensor in tensors.items():
                data, qtype = encoded(tensor_name, tensor, dtype)
                writer.add_tensor(tensor_name, data, raw_dtype=qtype)
                bar.update(tensor.nelement() * tensor.element_size())
            bar.set_postfix_str(f"writing {Path(out).name}")
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def gguf_arch(cfg: ModelConfig):
    import gguf

    if cfg.arch == "gpt2":
        return gguf.MODEL_ARCH.GPT2
    return gguf.MODEL_ARCH.QWEN3 if is_qwen3(cfg) else gguf.MODEL_ARCH.LLAMA


# --- weights ---


def gguf_tensors(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weights (tied aliases left out) -> llama.cpp's names and layouts, float32."""
    import gguf

    try:
        hf = to_hf_weights(cfg, weights)
    except UserError as e:
        raise UserError(f"GGUF export maps the weights through Hugging Face's names: {e}") from None
    names = gguf.get_tensor_name_map(gguf_arch(cfg), cfg.n_layer)
    out = {}
    for hf_name, tensor in hf.items():
        tensor = tensor.float()
        if cfg.arch == "llama" and not is_qwen3(cfg) and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.n_head if "q_proj" in hf_name else cfg.n_kv_head or cfg.n_head
            tensor = rope_pairs_layout(tensor, heads)
        if cfg.arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            tensor = tensor.t()  # Conv1D stores (in, out)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise AssertionError(f"gguf has no name for {hf_name}")
        out[gguf_name] = tensor.contiguous()
    return out


def rope_pairs_layout(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A q or k projection's rows, per head, from rotate-half order (dimension i rotates with i + d/2)
    to adjacent pairs (2i with 2i + 1), llama.cpp's RoPE: convert_hf_to_gguf's LlamaModel.permute."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def encoded(name: str, tensor: torch.Tensor, dtype: str):
    """-> (the tensor's numpy data as the file stores it, its GGML type): convert_hf_to_gguf's choice."""
    import gguf

    data = tensor.numpy()
    keep_f32 = data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
    if keep_f32 or name.startswith("position_embd."):
        return data, gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.Q8_0
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # a row that is not a multiple of q8_0's 32-value blocks
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def add_hyper_parameters(writer, cfg: ModelConfig) -> None:
    """The keys llama.cpp reads for the architecture (llama.{key}, qwen3.{key} or gpt2.{key})."""
    writer.add_context_length(cfg.seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(resolve_d_ff(cfg))
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head or cfg.n_head)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.arch == "llama":
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_rope_dimension_count(cfg.d_model // cfg.n_head)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
    else:
        writer.add_layer_norm_eps(cfg.norm_eps)


# --- tokenizer ---


def gguf_vocabulary(tokenizer, seq_len: int) -> dict:
    """The tokenizer as llama.cpp's keys want it, from the Hugging Face files the hf export writes:
    {"pre", "tokens", "types", "merges", "bos", "eos", "add_bos", "chat_template"}."""
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        hf_tokenizer_files(tokenizer, Path(tmp), model_max_length=seq_len)
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text(encoding="utf-8"))
        pre = pre_tokenizer(spec, tokenizer.name)
        merges = gguf.SpecialVocab(tmp, load_merges=True).merges  # both of tokenizer.json's merge formats
    tokens = [f"[PAD{i}]" for i in range(tokenizer.vocab_size)]  # ids no token has (an hf: file's gaps)
    types = [gguf.TokenType.UNUSED] * tokenizer.vocab_size
    for text, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    chat_end = tokenizer.special_tokens.get("<|assistant_end|>")  # a chat model ends its turn there
    return {
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": tokenizer.eot_id if tokenizer.bos_id is None else tokenizer.bos_id,
        "eos": tokenizer.eot_id if chat_end is None else chat_end,
        "add_bos": tokenizer.bos_id is not None,  # as `pretrainer sample` starts a prompt
        "chat_template": config.get("chat_template"),
    }


def pre_tokenizer(spec: dict, name: str) -> str:
    """llama.cpp's name for the split a Hugging Face tokenizer.json does before its byte-level BPE."""
    model, pre, decoder = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = steps[-1] if steps[-1].get("type") == "ByteLevel" else {}
    if (
        model.get("type") != "BPE"
        or not byte_level
        or decoder.get("type") != "ByteLevel"
        or spec.get("normalizer")
    ):
        raise UserError(
            f"tokenizer {name}: llama.cpp's gpt2 tokenizer is a byte-level BPE without a normalizer, which "
            f"this one is not; export it with --format hf"
        )
    if byte_level.get("add_prefix_space"):
        raise UserError(f"tokenizer {name}: adds a prefix space, which llama.cpp's gpt2 tokenizer does not")
    if len(steps) == 1 and byte_level.get("use_regex", True):
        pattern = GPT2_PATTERN  # ByteLevel's own split is GPT-2's regex
    elif len(steps) == 2 and steps[0].get("type") == "Split" and not byte_level.get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
    else:
        pattern = None
    if pattern not in PRE_TOKENIZERS:
        raise UserError(
            f"tokenizer {name}: its pre-tokenizer is not one llama.cpp reproduces (GPT-2's or Llama-3's "
            f"split); export it with --format hf"
        )
    return PRE_TOKENIZERS[pattern]


def add_vocabulary(writer, vocabulary: dict) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for a byte-level BPE
    writer.add_tokenizer_pre(vocabulary["pre"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    writer.add_token_merges(vocabulary["merges"])
    writer.add_bos_token_id(vocabulary["bos"])
    writer.add_eos_token_id(vocabulary["eos"])
    writer.add_add_bos_token(vocabulary["add_bos"])
    writer.add_add_eos_token(False)
    if vocabulary["chat_template"]:
        writer.add_chat_template(vocabulary["chat_template"])
