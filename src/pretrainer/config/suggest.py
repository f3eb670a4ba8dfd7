"""Which config key did the user mean? Words first, then letters.

    suggest("optim.learning_rate", key_help())  -> ["optim.lr"]

Letters alone (difflib) catch typos (`optim.lrr`) but not the names other trainers use
(`learning_rate`, `hidden_size`, `num_layers`). So a key is split into words (on '.', '_', '-'),
those names are mapped to the words of ours, and each valid key is scored by the words it shares
with the typed one, in its name and in its help text, then by its section and letter similarity.
"""

from __future__ import annotations

import difflib
import re

# Names from other trainers (Hugging Face, nanoGPT, Megatron) and common abbreviations -> our words.
# A phrase is matched on the key's words joined by "_", so "num_layers" also matches "model.num-layers".
SYNONYMS = {
    "learning_rate": "lr",
    "learning": "lr",
    "learningrate": "lr",
    "batch_size": "micro_batch global_batch",
    "batch": "micro_batch global_batch",
    "bs": "micro_batch global_batch",
    "hidden_size": "d_model",
    "hidden": "d_model",
    "dim": "d_model",
    "embd": "d_model",
    "n_embd": "d_model",
    "embed_dim": "d_model",
    "width": "d_model",
    "num_layers": "n_layer",
    "n_layers": "n_layer",
    "layers": "n_layer",
    "num_hidden_layers": "n_layer",
    "depth": "n_layer",
    "num_heads": "n_head",
    "n_heads": "n_head",
    "heads": "n_head",
    "num_attention_heads": "n_head",
    "kv_heads": "n_kv_head",
    "num_key_value_heads": "n_kv_head",
    "n_kv_heads": "n_kv_head",
    "intermediate_size": "d_ff",
    "ffn": "d_ff",
    "ff": "d_ff",
    "mlp": "d_ff",
    "block_size": "seq_len",
    "context": "seq_len",
    "context_length": "seq_len",
    "seq_length": "seq_len",
    "sequence_length": "seq_len",
    "n_ctx": "seq_len",
    "max_position_embeddings": "seq_len",
    "vocab": "vocab_size",
    "tie_word_embeddings": "tie_embeddings",
    "steps": "max_steps",
    "iters": "max_steps",
    "max_iters": "max_steps",
    "iterations": "max_steps",
    "total_steps": "max_steps",
    "epochs": "max_steps",
    "warmup": "warmup_steps",
    "warmup_iters": "warmup_steps",
    "min_lr": "min_lr_ratio",
    "scheduler": "schedule",
    "wd": "weight_decay",
    "epsilon": "eps",
    "clip": "grad_clip",
    "clipping": "grad_clip",
    "max_grad_norm": "grad_clip",
    "gradient": "grad",
    "accumulation": "grad_accum",
    "gradient_accumulation_steps": "grad_accum",
    "precision": "dtype",
    "mixed_precision": "dtype",
    "gradient_checkpointing": "activation_checkpointing",
    "interval": "every",
    "freq": "every",
    "frequency": "every",
    "optimizer": "optim",
    "optimiser": "optim",
    "checkpoint": "ckpt",
    "training": "train",
    "evaluation": "eval",
    "logging": "log",
    "output_dir": "run dir",
    "out_dir": "run dir",
    "pretrained": "init from",
}
STOP_WORDS = set(
    "a an and as at be by e for from g if in is it its of on or than the then this to when with".split()
)


def _singular(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def words(text: str) -> list[str]:
    """'optim.learning-rate' -> ['optim', 'learning', 'rate']."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _help_words(help: str) -> set[str]:
    return {w for w in expand(help) if w not in STOP_WORDS and not w.isdigit()}


def expand(text: str) -> set[str]:
    """The words of `text`, singular, plus our words for any phrase in it that SYNONYMS knows."""
    raw = words(text)
    out = {_singular(w) for w in raw}
    for n in range(1, len(raw) + 1):
        for i in range(len(raw) - n + 1):
            phrase = raw[i : i + n]
            for candidate in ("_".join(phrase), "_".join(map(_singular, phrase))):
                out.update(_singular(w) for w in words(SYNONYMS.get(candidate, "")))
    return out


def _score(key: str, candidate: str, help: str) -> tuple[float, bool]:
    """(score, meaningful): the name's words weigh most, then help words, the section, letters."""
    section, _, name = key.partition(".") if "." in key else ("", "", key)
    c_section, _, c_name = candidate.partition(".")
    typed = expand(name)
    # 'n' of n_head is not a word to match
    c_words = {_singular(w) for w in words(c_name) if len(w) > 1} or {c_name}
    name_hits = len(typed & c_words) / len(c_words)  # how much of the candidate's name the typed key explains
    help_hits = min(1.0, len(typed & (_help_words(help) - c_words)) / 2)
    same_section = float(c_section in expand(section)) if section else 0.0
    letters = difflib.SequenceMatcher(None, name.lower().replace("-", "_"), c_name).ratio()
    return 2 * name_hits + 0.5 * help_hits + 0.3 * same_section + letters, name_hits > 0 or letters >= 0.7


def suggest(key: str, helps: dict[str, str], n: int = 2) -> list[str]:
    """Up to n valid keys close to `key` (best first), or [] when none is close in words or letters."""
    scored = sorted(((*_score(key, k, h), k) for k, h in helps.items()), key=lambda s: (-s[0], s[2]))
    best = scored[0][0]
    return [k for score, meaningful, k in scored[:n] if meaningful and score >= best - 0.25]
