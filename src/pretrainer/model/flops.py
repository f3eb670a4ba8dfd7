"""FLOPs per token for training (forward + backward), the nanoGPT / PaLM accounting:

    flops_per_token = 6 * N + 6 * n_layer * n_head * head_dim * seq_len

N counts the parameters that take part in matrix multiplies: the non-embedding parameters plus
the output projection (vocab x d_model), which is a matmul even when it is tied to the token
embedding. Embedding lookups cost no FLOPs. The second term is attention's QK^T and AV products under
the causal mask: a token attends to seq_len / 2 positions on average, and the flash kernels skip the
masked half, so nanoGPT's and PaLM's 12 (the full seq_len) would count work no GPU does and lift MFU.
"""

from __future__ import annotations

from pretrainer.config.schema import ModelConfig


def flops_per_token(cfg: ModelConfig, non_embedding_params: int) -> dict:
    # untied: already non-embedding
    output_projection = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    n_matmul = non_embedding_params + output_projection
    head_dim = cfg.d_model // cfg.n_head
    attention = 6 * cfg.n_layer * cfg.n_head * head_dim * cfg.seq_len  # causal: half of 12 x seq_len
    return {
        "n_matmul_params": n_matmul,
        "dense": 6 * n_matmul,
        "attention": attention,
        "total": 6 * n_matmul + attention,
    }


def flops_per_token_6n(non_embedding_params: int) -> int:
    """The Kaplan/Chinchilla C = 6ND convention with N = non-embedding parameters: no output
    projection, no attention. Cheaper to state, and what many budgets (e.g. the X1 lab) use; it
    undercounts the work of small models with large vocabularies."""
    return 6 * non_embedding_params
