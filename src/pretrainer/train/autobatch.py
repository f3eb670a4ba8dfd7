"""train.micro_batch = auto: the largest micro-batch whose full training steps fit in GPU memory.

Each try runs TRIAL_STEPS real steps (forward, backward, AdamW) of the run's own configuration:
the same model with its activation checkpointing and per-block compile, the same autocast and the
same fused loss. DDP wraps nothing that costs memory here (gradients live in its buckets:
gradient_as_bucket_view), so one device measures what a DDP rank needs; FSDP is refused (its
memory depends on the other ranks). No collective runs during the search, so an out-of-memory
error on one rank cannot deadlock the others; the ranks then agree on the smallest result.

Candidates are the divisors of the per-rank batch (global_batch / world_size), so the global batch
is kept exactly and grad_accum absorbs the difference. The search grows from the smallest (each
try about double the last) until one does not fit, then bisects between the largest that fit and
the smallest that did not: few out-of-memory errors, each try's memory released before the next.
A size fits when its trial's peak stays under HEADROOM of the GPU's memory, with its gradients kept
allocated between steps (as a DDP rank keeps them).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from pretrainer.config.schema import Config
from pretrainer.core.device import autocast, compiles
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer
from pretrainer.model.attention_probe import flex_attention_problem
from pretrainer.optim.registry import build_optimizer

TRIAL_STEPS = 3
# a size fits when its trial's peak stays under this share of the GPU's memory: the run's own steps
# allocate a little differently (the data, logging, evaluation, fragmentation), and the largest size that
# only just fit in the trial would fail at step 1
HEADROOM = 0.90


def largest_that_fits(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """The largest of the ascending `candidates` for which fits() holds (0 if none), assuming that what
    fits is a prefix: grow by doubling, then bisect."""
    good, bad, index = -1, len(candidates), 0  # candidates[good] fits, candidates[bad] does not
    while index < len(candidates):
        if not fits(candidates[index]):
            bad = index
            break
        good = index
        doubled = [i for i in range(index + 1, len(candidates)) if candidates[i] >= 2 * candidates[index]]
        index = (
            doubled[0] if doubled else len(candidates) - 1 if index < len(candidates) - 1 else len(candidates)
        )
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(candidates[middle]):
            good = middle
        else:
            bad = middle
    return candidates[good] if good >= 0 else 0


def trial_fits(
    cfg: Config, micro_batch: int, device: torch.device, amp_dtype: torch.dtype | None, say
) -> bool:
    """TRIAL_STEPS full steps at this micro-batch -> did they fit? Everything the try allocated is freed
    before returning, whatever happened."""
    model = optimizer = ids = loss = None
    fitted = False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = Transformer(cfg.model).to(device)
        # document packing: the run's mask (flex attention's BlockMask on CUDA) with a few documents a row
        separator = cfg.model.vocab_size - 1 if cfg.data.packing == "document" else None
        model.flex_documents = (  # as the run will: flex where it runs here (train/perf.py)
            separator is not None
            and device.type == "cuda"
            and not flex_attention_problem(cfg.model, device, amp_dtype)
        )
        compiled = compiles(cfg.train.compile, device)
        model.configure_blocks(cfg.train.activation_checkpointing, compiled)
        optimizer = build_optimizer(model, cfg.optim, device.type, compile_step=compiled)
        for _ in range(TRIAL_STEPS):
            ids = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1), device=device)
            if separator is not None:
                ids[:, :: max(2, cfg.model.seq_len // 4)] = separator
            with autocast(device, amp_dtype):
                loss = model(ids[:, :-1], ids[:, 1:], doc_separator=separator)[1]
            loss.backward()
            loss = None
            optimizer.step()
            # the gradients stay allocated between steps, as in a DDP rank (its buckets) and the loop
            optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak, total = (
                torch.cuda.max_memory_allocated(device),
                torch.cuda.get_device_properties(device).total_memory,
            )
            fitted = peak <= HEADROOM * total
            if not fitted:
                say(
                    f"micro-batch {micro_batch}: peak {peak / 2**30:.1f} GiB, over {HEADROOM:.0%} of "
                    f"{total / 2**30:.1f} GiB"
                )
        else:
            fitted = True
    except (
        torch.OutOfMemoryError,
        RuntimeError,
    ) as error:  # compile/autotuning can report it as a RuntimeError
        if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error).lower():
            raise
        say(f"micro-batch {micro_batch}: out of memory")
    # after the except block: its traceback (which holds the try's tensors) is gone, so this frees them all
    model = optimizer = ids = loss = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fitted


def find_micro_batch(
    cfg: Config,
    per_rank_batch: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    *,
    say=print,
    fits: Callable[[int], bool] | None = None,
) -> int:
    """`fits` replaces the real trial (tests simulate a memory limit on CPU with it)."""
    if fits is None and device.type != "cuda":
        raise UserError(
            "train.micro_batch = auto searches GPU memory and needs CUDA; on CPU set a number, e.g. "
            "--train.micro_batch=8"
        )
    if cfg.parallel.strategy == "fsdp":
        raise UserError(
            "train.micro_batch = auto is not supported with parallel.strategy = fsdp; set train.micro_batch"
        )
    candidates = [b for b in range(1, per_rank_batch + 1) if per_rank_batch % b == 0]
    # the run's initialisation is unchanged
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        found = largest_that_fits(candidates, fits or (lambda b: trial_fits(cfg, b, device, amp_dtype, say)))
    # the tries' graphs (a batch dimension made dynamic by several sizes) are not the run's
    if compiles(cfg.train.compile, device):
        torch._dynamo.reset()
    if device.type == "cuda":  # the peaks the run logs are its own, not the search's largest try
        torch.cuda.reset_peak_memory_stats(device)
    if not found:
        raise UserError(
            f"train.micro_batch = auto: even a micro-batch of 1 sequence of {cfg.model.seq_len} does not "
            f"fit; "
            f"use parallel.strategy = fsdp, a shorter model.seq_len or a smaller model"
        )
    say(
        f"micro-batch auto: {found} sequences fit ({TRIAL_STEPS} full "
        f"steps{', compiled' if compiles(cfg.train.compile, device) else ''}"
        f"{', activation checkpointing' if cfg.train.activation_checkpointing else ''})"
    )
    return found
