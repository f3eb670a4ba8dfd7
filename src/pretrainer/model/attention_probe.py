"""Which attention kernel a model really runs: SDPA's own choice for the first block's inputs at the
run's shape (flash, efficient, cudnn, math, ...), and whether compiled flex_attention can run document
masks on this GPU. Asked of torch, not assumed: a dtype, a head size or the GPU can rule flash out.

    attention_backend(model, seq_len, device, amp_dtype) -> "flash", "efficient", "cudnn", "math", ...
"""

from __future__ import annotations

import torch


def attention_backend(
    model: torch.nn.Module,
    seq_len: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    *,
    documents: bool = False,
    say=None,
) -> str:
    """The SDPA kernel the first block's attention actually runs for one sequence of the run's shape,
    gradients on: what PyTorch chose, not what we hope it chose (a dtype, a head size or the GPU can
    rule flash out). Grouped-query attention falls back to the math kernel (T x T scores) where flash
    cannot run it natively: then every layer is switched to repeated K/V and the probe runs again.
    documents (data.packing = document): probed with a document mask, as the run attends. On CUDA the
    mask is a flex_attention BlockMask (compiled: block-sparse, flash-like); where flex cannot run, an
    SDPA mask, which no flash kernel takes (the log then says math or efficient, not flash)."""
    if documents:
        model.flex_documents = False
        if device.type == "cuda":
            problem = flex_attention_problem(model.cfg, device, amp_dtype)
            if not problem:
                model.flex_documents = True
                return "flex (document mask)"
            if say is not None:
                say(
                    f"warning: flex attention cannot run here ({problem}); document masks go to SDPA's math "
                    f"or efficient kernel (slower, more memory)"
                )
        return f"{_probe_attention(model, seq_len, device, amp_dtype, documents=True)} (document mask)"
    kernel = _probe_attention(model, seq_len, device, amp_dtype)
    attentions = [block.attn for block in model.layers]
    if kernel == "math" and device.type == "cuda" and attentions[0].n_kv_head != attentions[0].n_head:
        for attention in attentions:
            attention.native_gqa = False
        kernel = _probe_attention(model, seq_len, device, amp_dtype)
    return kernel


_flex_problems: dict[tuple, str] = {}


def flex_attention_problem(cfg, device: torch.device, amp_dtype: torch.dtype | None) -> str:
    """ "" when compiled flex_attention runs a forward and a backward at the model's head shape and
    seq_len on this GPU with a document BlockMask, else why not (once per process and shape). Not under
    a dispatch mode, which would keep torch.compile out (and eager flex refuses one)."""
    from pretrainer.core.device import autocast
    from pretrainer.model.transformer import document_layout, flex_attention

    kv_heads, head_dim = cfg.n_kv_head or cfg.n_head, cfg.d_model // cfg.n_head
    key = (str(device), cfg.n_head, kv_heads, head_dim, cfg.seq_len, amp_dtype)
    if key not in _flex_problems:
        try:
            ids = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=device)
            ids[0, cfg.seq_len // 3], ids[0, 2 * cfg.seq_len // 3] = 1, 1
            mask = document_layout(ids, 1, flex=True)[1]
            dtype = amp_dtype or torch.float32
            shape = (1, cfg.n_head, cfg.seq_len, head_dim)
            q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            k, v = (
                torch.randn((1, kv_heads, *shape[2:]), device=device, dtype=dtype, requires_grad=True)
                for _ in range(2)
            )
            with autocast(device, amp_dtype):
                flex_attention(q, k, v, mask, enable_gqa=kv_heads != cfg.n_head).sum().backward()
            _flex_problems[key] = ""
        except Exception as e:  # noqa: BLE001 (compile or kernel: the SDPA mask still trains)
            _flex_problems[key] = f"{type(e).__name__}: {str(e).strip()[:160]}"
    return _flex_problems[key]


# torch's SDPBackend values (torch.nn.attention.SDPBackend), as _fused_sdp_choice returns them
SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def _probe_attention(
    model: torch.nn.Module,
    seq_len: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    documents: bool = False,
) -> str:
    """The kernel SDPA runs for the first block's attention, asked of torch with the very inputs the
    block gives it (torch._fused_sdp_choice: the choice scaled_dot_product_attention makes itself, from
    the tensors, the mask and the backends enabled). Not through a dispatch mode, whose first use costs
    every launch a second of imports (torch._dynamo)."""
    import torch.nn.functional as F

    from pretrainer.core.device import autocast

    chosen: list[int] = []
    real = F.scaled_dot_product_attention

    # SDPA's own signature: whatever the block passes it, positionally or not
    def asking(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: PLR0917
        chosen.append(
            torch._fused_sdp_choice(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        )
        return real(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    block = model.layers[0]
    # kernels differ with grad on
    x = torch.zeros(1, seq_len, model.cfg.d_model, device=device, requires_grad=True)
    rope = (model.rope_cos, model.rope_sin) if model.cfg.arch == "llama" else None
    mask = None
    if documents:  # three documents in the sequence, as packing makes them
        from pretrainer.model.transformer import document_layout

        ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
        ids[0, seq_len // 3], ids[0, 2 * seq_len // 3] = 1, 1
        mask = document_layout(ids, 1, flex=model.flex_documents)[1]
    F.scaled_dot_product_attention = asking  # for this one forward, on this thread, before training starts
    try:
        with autocast(device, amp_dtype):
            block.attn(block.attn_norm(x), rope, None, mask)
    finally:
        F.scaled_dot_product_attention = real
    return SDPA_KERNELS.get(chosen[0], "unknown") if chosen else "unknown"
