"""Llama-style and GPT-2-style decoder-only transformers in one small module.

arch = "llama": RMSNorm, SwiGLU MLP, rotary position embeddings (RoPE, the rotate-half layout used
                by Hugging Face Llama), grouped-query attention (n_kv_head < n_head), no biases,
                tied embeddings optional.
arch = "gpt2":  LayerNorm, GELU (tanh) MLP, learned absolute positions, biases everywhere,
                tied embeddings.

Both are pre-norm residual stacks using torch's scaled_dot_product_attention (flash/efficient
kernels on GPU). Parameter names follow Hugging Face Llama (q_proj, k_proj, ...) so that weights
map one-to-one onto reference implementations.

Initialisation (documented scheme, GPT-2 / nanoGPT): every Linear and Embedding weight ~ N(0, init_std)
with init_std = 0.02; the two projections that write into the residual stream (attention o_proj and
the MLP's down projection) use init_std / sqrt(2 * n_layer) so the residual variance does not grow
with depth; biases are zero; norm weights are one.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pretrainer.config.resolve import resolve_d_ff, uses_qk_norm
from pretrainer.config.schema import ModelConfig
from pretrainer.model.loss import IGNORE_INDEX, linear_cross_entropy  # noqa: F401 (IGNORE_INDEX: re-exported)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq_len, head_dim), rotate-half layout
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys and values of every layer for incremental decoding; `pos` tokens are filled."""

    def __init__(
        self,
        *,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        bias = cfg.arch == "gpt2"
        qkv_bias = bias if cfg.qkv_bias == "auto" else cfg.qkv_bias == "true"
        self.q_proj = nn.Linear(cfg.d_model, self.n_head * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=bias)
        self.dropout = cfg.dropout  # of the attention probabilities, while training
        self.qk_norm, self.norm_eps = uses_qk_norm(cfg), cfg.norm_eps
        # grouped-query attention read natively by SDPA (enable_gqa: no K/V copies). On CUDA only the flash
        # kernel supports it; where flash is ruled out the trainer's probe (train/perf.py) turns this off,
        # so the efficient kernel runs on repeated K/V instead of the math kernel's T x T scores.
        self.native_gqa = True

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: the cos and sin of each position of x ((T, head_dim), or (B, 1, T, head_dim) when
        positions restart per document); attn_mask (B, 1, T, T): which keys each query sees (document
        masking), None: causal."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        start = cache.pos if cache is not None else 0
        if self.qk_norm:  # before RoPE with the model's eps, as Qwen3 (its export) and llama.cpp compute it
            q = F.rms_norm(q, (self.head_dim,), eps=self.norm_eps)
            k = F.rms_norm(k, (self.head_dim,), eps=self.norm_eps)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        gqa = self.n_kv_head != self.n_head  # each kv head serves n_head/n_kv_head query heads
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):  # a BlockMask: flex attention
            y = flex_attention(q, k, v, attn_mask, enable_gqa=gqa)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        # masked paths, or no flash: repeat K/V
        if gqa and (start > 0 or not self.native_gqa or attn_mask is not None):
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            gqa = False
        dropout = self.dropout if self.training else 0.0
        if attn_mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, dropout_p=dropout)
        else:  # decoding after a prefix: query i (absolute start + i) sees keys 0..start + i
            visible = (
                torch.arange(k.size(2), device=x.device)[None, :]
                <= (start + torch.arange(T, device=x.device))[:, None]
            )
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


def document_layout(idx: torch.Tensor, separator: int, flex: bool = False) -> tuple[torch.Tensor, Any]:
    """idx (B, T) holding documents that each end with `separator` -> (each token's position within
    its document (B, T), which keys each query may see: causal and the same document). The separator
    belongs to the document it ends; a row may start or end mid-document. The mask is (B, 1, T, T) for
    SDPA, which then runs its math or efficient kernel (no flash kernel takes a mask); flex: a
    flex_attention BlockMask, whose kernel skips the masked blocks as flash skips the causal half."""
    T = idx.size(1)
    ends = idx == separator
    document = torch.cumsum(ends, dim=1) - ends.long()
    index = torch.arange(T, device=idx.device)
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]
    positions = index - torch.where(starts, index, 0).cummax(dim=1).values
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, k):
            return (document[b, q] == document[b, k]) & (k <= q)

        return positions, create_block_mask(same_document_causal, idx.size(0), None, T, T, device=idx.device)
    visible = (document[:, :, None] == document[:, None, :]) & (index[None, :] <= index[:, None])[None]
    return positions, visible[:, None]


_flex_attention = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, enable_gqa: bool):
    """torch's flex_attention, compiled once per process on CUDA (eagerly it materialises every score,
    as SDPA's math kernel does: what it does on CPU, where the trainer does not use it)."""
    global _flex_attention
    from torch.nn.attention.flex_attention import flex_attention as plain

    if not q.is_cuda:
        return plain(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _flex_attention is None:
        _flex_attention = torch.compile(plain, dynamic=False)
    return _flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d_ff = resolve_d_ff(cfg)
        self.kind = "relu2" if cfg.mlp == "relu2" else cfg.arch
        if self.kind == "relu2":
            self.up_proj = nn.Linear(cfg.d_model, d_ff, bias=cfg.arch == "gpt2")
            self.down_proj = nn.Linear(d_ff, cfg.d_model, bias=cfg.arch == "gpt2")
        elif cfg.arch == "llama":
            self.gate_proj = nn.Linear(cfg.d_model, d_ff, bias=False)
            self.up_proj = nn.Linear(cfg.d_model, d_ff, bias=False)
            self.down_proj = nn.Linear(d_ff, cfg.d_model, bias=False)
        else:
            self.up_proj = nn.Linear(cfg.d_model, d_ff, bias=True)
            self.down_proj = nn.Linear(d_ff, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kind == "relu2":
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()  # of each residual branch

    def forward(
        self, x: torch.Tensor, rope, cache: KVCache | None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, cache, attn_mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size must be resolved (from the data manifest) before building the model"
            )
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # activation checkpointing: keep block inputs only, recompute in backward
        self.checkpoint_blocks = self.compile_loss = False
        # document masks as flex_attention BlockMasks (the trainer turns it on where its probe ran it: CUDA)
        self.flex_documents = False
        self.norm = _norm(cfg)
        self.embedding_drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if cfg.arch == "llama":
            cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std, residual_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(
                    module.weight, 0.0, residual_std if name.endswith(("o_proj", "down_proj")) else std
                )
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        per_token: bool = False,
        last_only: bool = False,
        doc_separator: int | None = None,
    ):
        """idx (B, T) token ids -> (logits (B, T, vocab), None) without targets; with targets (B, T) ->
        (None, mean cross-entropy over targets != IGNORE_INDEX): the loss is computed by the fused,
        chunked output projection (model/loss.py), so the full logits are never made or kept.
        per_token (evaluation): -> (each target's loss (B, T), the mean loss). last_only: logits
        (B, 1, vocab) of the last position only (a prefill that only needs the next token's).
        doc_separator (data.packing = document): each row holds several documents, each ending with
        this id; a token attends only within its document and positions restart at each."""
        T = idx.size(1)
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.seq_len {self.cfg.seq_len}")
        positions, attn_mask = (
            document_layout(idx, doc_separator, flex=self.flex_documents)
            if doc_separator is not None and kv_cache is None
            else (None, None)
        )
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(
                torch.arange(start, start + T, device=idx.device) if positions is None else positions
            )
        x = self.embedding_drop(x)
        rope = None
        if self.cfg.arch == "llama":
            rope = (
                (self.rope_cos[start : start + T], self.rope_sin[start : start + T])
                if positions is None
                else (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
            )
        for block in self.layers:
            if self.checkpoint_blocks and self.training and kv_cache is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, None, attn_mask, use_reentrant=False)
            else:
                x = block(x, rope, kv_cache, attn_mask)
        if kv_cache is not None:
            kv_cache.pos += T
        if targets is not None and per_token:
            mean, losses = linear_cross_entropy(
                self.norm(x), self.lm_head.weight, targets, per_token=True, compiled=self.compile_loss
            )
            return losses, mean
        if targets is not None:
            return None, linear_cross_entropy(
                self.norm(x), self.lm_head.weight, targets, compiled=self.compile_loss
            )
        return self.lm_head(self.norm(x[:, -1:] if last_only else x)), None

    def _apply(self, fn, recurse=True):
        """.to(bfloat16), .half() and the like cast the weights, not the RoPE tables: rounded to bf16,
        a position's angle is off by up to ~0.4% and its rotation with it (training keeps them fp32
        under autocast). Moves (.to(device)) move them."""
        tables = {name: table for name, table in self._buffers.items() if name.startswith("rope_")}
        out = super()._apply(fn, recurse)
        for name, table in tables.items():
            moved = self._buffers[name]
            if moved is not None and moved.dtype != table.dtype:
                self._buffers[name] = table.to(moved.device)
        return out

    def configure_blocks(self, checkpointing: bool, compile: bool) -> None:
        """For training: activation checkpointing (each block recomputed in backward) and each block
        compiled in place (state-dict names unchanged; FSDP's hooks stay outside the graphs). Before
        any DDP/FSDP wrapping: torchtitan's order is checkpointing, compile, shard. On CUDA the fused
        loss's per-chunk math is compiled too (it sits outside the blocks; on a CPU its fusion does not
        win back inductor's compile time)."""
        on_gpu = any(p.device.type == "cuda" for p in self.parameters())
        self.checkpoint_blocks, self.compile_loss = checkpointing, compile and on_gpu
        if compile:
            for block in self.layers:
                # PRETRAINER_COMPILE_BACKEND=aot_eager: dynamo and autograd's tracing without inductor's code
                # generation, torch's own first step in bisecting a compile problem. dynamic=False: a second
                # shape would otherwise turn the graph dynamic (other kernels), and a resumed run, which
                # meets the shapes in another order, would not compute what an uninterrupted one did
                block.compile(backend=os.environ.get("PRETRAINER_COMPILE_BACKEND", "inductor"), dynamic=False)

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        attn = self.layers[0].attn
        return KVCache(
            n_layer=self.cfg.n_layer,
            batch=batch,
            n_kv_head=attn.n_kv_head,
            max_len=max_len or self.cfg.seq_len,
            head_dim=attn.head_dim,
            device=self.wte.weight.device,
            dtype=self.wte.weight.dtype,
        )

    def tied_aliases(self) -> list[str]:
        """State-dict keys that are the same tensor as another key (left out when saving)."""
        return ["lm_head.weight"] if self.cfg.tie_embeddings else []


def count_parameters(model: Transformer) -> dict[str, int]:
    """Unique parameters (tied weights once). Non-embedding leaves out the token and position
    embeddings but keeps an untied lm_head, the convention of Kaplan et al. and nanoGPT."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.wte.weight.numel() + (model.wpe.weight.numel() if model.wpe is not None else 0)
    return {"total": total, "non_embedding": total - embedding}


def total_parameters(cfg: ModelConfig) -> int:
    """Unique parameters of cfg's model (count_parameters' total), built on the meta device: no memory."""
    with torch.device("meta"):
        return count_parameters(Transformer(cfg))["total"]
