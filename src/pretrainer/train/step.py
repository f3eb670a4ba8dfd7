"""One optimizer step's forward and backward over its micro-batches (the loss weighted by counted targets,
gradients reduced on the last)."""

from __future__ import annotations

import torch

from pretrainer.core.device import autocast
from pretrainer.train.distributed import DistEnv, gradient_sync, mean_across_ranks


def forward_backward(
    wrapped: torch.nn.Module,
    micro_batches,
    counts: tuple[list[int], int],
    *,
    strategy: str,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
    separator: int | None = None,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, gradients reduced across ranks on the last
    one only. The step's loss is the mean over every counted target of the step, all micro-batches and
    ranks together: `counts` = (this rank's counted targets per micro-batch, the whole step's), so
    micro-batch k's mean is weighted by count_k x world size / step count (ranks average gradients).
    When every target counts this is 1 / grad_accum for each. -> the step's loss, the same on every rank."""
    local, step_count = counts
    # every micro-batch counts the same targets: mean / grad_accum, as plain pretraining
    uniform = len(set(local)) == 1
    loss_sum = torch.zeros((), device=env.device)
    for micro_step, (x, y) in enumerate(micro_batches):
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        # how many times smaller this micro-batch's mean is than its share of the step's mean (inf: no counted
        # targets)
        divisor = step_count / (local[micro_step] * env.world_size) if local[micro_step] else float("inf")
        with gradient_sync(wrapped, strategy, env, sync=micro_step == len(micro_batches) - 1):
            with autocast(env.device, amp_dtype):
                _, loss = wrapped(x, y, doc_separator=separator)
            (loss / divisor).backward()
        loss_sum += loss.detach() if uniform else loss.detach() / divisor
    return mean_across_ranks(loss_sum / divisor if uniform else loss_sum, env)
