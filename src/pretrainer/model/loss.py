"""The output projection and the cross-entropy in one pass, chunked over tokens, so the full logits
(tokens x vocab, in bf16 and again in fp32 for the softmax) never exist at once.

At vocab 131,072 and 16K tokens per micro-batch the plain way (`F.cross_entropy(lm_head(h).float())`)
keeps 8 GiB of fp32 logits (plus a 4 GiB bf16 copy) alive from the forward to the backward. Here
the forward walks the tokens in chunks of at most LOSS_CHUNK_ELEMENTS / vocab: logits of the chunk,
its loss, and at once its gradient (softmax - one-hot), turned into the gradients of the hidden
states and of the weight. Only those two are kept for the backward, which just scales them by the
incoming gradient. Same FLOPs as the plain way (the gradient matmuls move from the backward into the
forward), and the same math: the mean over the targets that are not IGNORE_INDEX.
"""

from __future__ import annotations

import torch

from pretrainer import IGNORE_INDEX  # noqa: F401 (re-exported: the loss skips these targets)
from pretrainer.core.hardware import MATMUL_ALIGNMENT

# Logits per chunk. Each chunk costs a vocab x d gradient product added into the fp32 weight gradient
# (memory traffic ~12 x vocab x d bytes), so chunks are large: at vocab 131,072 one chunk is 2,048
# tokens (1.5 GiB of logits in bf16 + fp32), 8 chunks for a 16K-token micro-batch.
LOSS_CHUNK_ELEMENTS = 2**28


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as LOSS_CHUNK_ELEMENTS allows, rounded down to a multiple of 128 (the
    chunk is a matmul dimension: 5,341 tokens at GPT-2's vocabulary would leave every tile ragged)."""
    return max(MATMUL_ALIGNMENT, LOSS_CHUNK_ELEMENTS // vocab_size // MATMUL_ALIGNMENT * MATMUL_ALIGNMENT)


def _chunk_math(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, grads: bool):
    """One chunk's fp32 work on its logits (compute dtype): -> (each target's loss, 0 where not kept;
    d(summed loss)/d(logits) = softmax - one-hot in the compute dtype, or None). Eagerly this is ~10
    kernels with an fp32 copy of the logits; compiled (train.compile), inductor fuses it into a couple."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    rows, safe_targets = torch.arange(len(targets), device=logits.device), targets.clamp(min=0)
    token_losses = (log_z - logits[rows, safe_targets]) * keep
    if not grads:
        return token_losses, None
    grad_logits = logits.sub_(log_z[:, None]).exp_()  # made in place of the fp32 logits
    grad_logits[rows, safe_targets] -= 1.0
    grad_logits *= keep[:, None]
    return token_losses, grad_logits


_compiled_chunk_math = None


def chunk_math(compiled: bool):
    """_chunk_math, compiled once per process when asked (a shape of its own for a last, shorter chunk)."""
    global _compiled_chunk_math
    if not compiled:
        return _chunk_math
    if _compiled_chunk_math is None:
        _compiled_chunk_math = torch.compile(_chunk_math, dynamic=False)
    return _compiled_chunk_math


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    compute_dtype: torch.dtype,
    *,
    grads: bool,
    per_token: torch.Tensor | None = None,
    compiled: bool = False,
):
    """-> (mean loss, gradient of the summed loss wrt hidden and wrt weight (None, None without grads),
    count).
    `per_token` (tokens,), if given, receives each target's loss (0 where ignored): evaluation's bits per
    byte. compiled: the chunk's fp32 math through torch.compile."""
    chunk, math = loss_chunk_tokens(weight.size(0)), chunk_math(compiled)
    # the casts are explicit: autocast's dtype, made once
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        grad_hidden = torch.empty_like(h) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        counted = targets != IGNORE_INDEX
        for start in range(0, h.size(0), chunk):
            h_chunk, t_chunk, keep = (
                h[start : start + chunk],
                targets[start : start + chunk],
                counted[start : start + chunk],
            )
            token_losses, grad_logits = math(h_chunk @ w.t(), t_chunk, keep, grads)
            loss_sum += token_losses.sum()
            if per_token is not None:
                per_token[start : start + chunk] = token_losses
            if grads:
                grad_logits = grad_logits.to(compute_dtype)
                grad_hidden[start : start + chunk] = grad_logits @ w
                grad_weight += grad_logits.t() @ h_chunk  # (bf16 product added in fp32: no fp32 copy of it)
            # this chunk's logits and gradients go before the next chunk's are made: two alive at once
            # would double the transient memory the plan counts
            del token_losses, grad_logits
        count = counted.sum().clamp(min=1).float()
    return loss_sum / count, grad_hidden, grad_weight, count


class _LinearCrossEntropy(torch.autograd.Function):
    # positional only: Function.apply hands forward no keyword argument (without setup_context), and ruff
    # counts ctx
    @staticmethod
    def forward(  # noqa: PLR0917
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        compute_dtype: torch.dtype,
        compiled: bool,
    ):
        loss, grad_hidden, grad_weight, count = _chunked(
            hidden, weight, targets, compute_dtype, grads=True, compiled=compiled
        )
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count  # in place: the saved gradients are used once (the graph is not retained)
        return (
            grad_hidden.mul_(scale).to(ctx.dtypes[0]),
            grad_weight.mul_(scale).to(ctx.dtypes[1]),
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    per_token: bool = False,
    compiled: bool = False,
):
    """mean cross-entropy of softmax(hidden @ weight.T) against targets (IGNORE_INDEX left out), without
    materialising the logits. hidden (..., d), weight (vocab, d), targets (...). Under autocast the
    matmuls run in its dtype, the softmax in fp32, as `F.cross_entropy(linear(hidden).float())` does.
    per_token (evaluation only, no gradients): -> (the mean loss, each target's loss in targets' shape).
    compiled: each chunk's fp32 math compiled (train.compile)."""
    device_type = hidden.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    )
    shape, hidden, targets = targets.shape, hidden.flatten(0, -2), targets.flatten()
    if per_token:
        losses = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            mean = _chunked(
                hidden, weight, targets, compute_dtype, grads=False, per_token=losses, compiled=compiled
            )[0]
        return mean, losses.view(shape)
    # evaluation: the loss alone
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _chunked(hidden, weight, targets, compute_dtype, grads=False, compiled=compiled)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets, compute_dtype, compiled)
