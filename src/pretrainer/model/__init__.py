"""Decoder-only transformers (Llama- and GPT-2-style) and sampling with a KV cache."""

from pretrainer.model.transformer import KVCache, Transformer, count_parameters

__all__ = ["KVCache", "Transformer", "count_parameters"]
