"""Sampling with a KV cache: one prefill over the prompt, then one token per forward pass."""

from __future__ import annotations

import torch

from pretrainer.model.transformer import Transformer

GREEDY_BELOW = 1e-6  # a temperature this small samples the argmax anyway


@torch.no_grad()
def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    generator: torch.Generator | None,
    vocab_in_use: int | None = None,
) -> torch.Tensor:
    """logits (B, vocab) -> next ids (B, 1). temperature 0 is greedy (argmax), and so is one below
    GREEDY_BELOW (logits / T would overflow float32: no distribution is left to sample). vocab_in_use: the
    tokenizer's size; the rows above it (the model's vocabulary padded to a multiple of 128) are never
    chosen."""
    if vocab_in_use is not None and vocab_in_use < logits.size(-1):
        logits = logits[..., :vocab_in_use]
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def generation_bytes(model: Transformer, batch: int, prompt_len: int) -> int:
    """What generate() holds at its peak for `batch` rows, before it allocates anything: the KV cache
    (seq_len positions a row) and the prefill's logits (fp32), twice over for what a forward pass keeps."""
    attn, itemsize = model.layers[0].attn, model.wte.weight.element_size()
    cache = 2 * model.cfg.n_layer * batch * attn.n_kv_head * model.cfg.seq_len * attn.head_dim * itemsize
    logits = batch * min(prompt_len, model.cfg.seq_len) * model.cfg.vocab_size * 4
    return cache + 2 * logits


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
    vocab_in_use: int | None = None,
) -> torch.Tensor:
    """prompt (B, T) -> (B, T + n) with n <= max_new_tokens; stops early once every row has emitted stop_id.

    The context is the model's seq_len: when the cache is full, the last seq_len // 2 tokens are
    re-encoded into a fresh cache (a sliding window, recomputed in one prefill), so generation can
    run past seq_len at the cost of one prefill every seq_len // 2 tokens.
    """
    model.eval()
    seq_len = model.cfg.seq_len
    out = prompt
    context = prompt[:, -seq_len:]
    cache = model.new_kv_cache(prompt.size(0))
    logits, _ = model(context, kv_cache=cache)
    finished = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        next_id = sample_next(logits[:, -1], temperature, top_k, generator, vocab_in_use)
        out = torch.cat([out, next_id], dim=1)
        if stop_id is not None:
            finished |= next_id.squeeze(1) == stop_id
            if finished.all():
                break
        if cache.pos >= seq_len:
            cache = model.new_kv_cache(prompt.size(0))
            logits, _ = model(out[:, -(seq_len // 2) :], kv_cache=cache)
        else:
            logits, _ = model(next_id, kv_cache=cache)
    return out


@torch.no_grad()
def stream(
    model: Transformer,
    new_ids: list[int],
    cache,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_ids: tuple[int, ...] = (),
    vocab_in_use: int | None = None,
):
    """One row, token by token: feed `new_ids` into `cache` (a prefill of only what the cache does not
    hold yet), then yield sampled ids until one in stop_ids (yielded too), max_new_tokens, or a full
    context. The ids yielded are in the cache except the last one: the caller feeds it with the next turn."""
    model.eval()
    device = model.wte.weight.device
    logits, _ = model(
        torch.tensor([new_ids], dtype=torch.long, device=device), kv_cache=cache, last_only=True
    )
    for produced in range(max_new_tokens):
        next_id = sample_next(logits[:, -1], temperature, top_k, generator, vocab_in_use)
        yield int(next_id)
        if int(next_id) in stop_ids or produced + 1 == max_new_tokens or cache.pos >= model.cfg.seq_len:
            return
        logits, _ = model(next_id, kv_cache=cache)
