"""One batch size's serving speed as serve-cost's table row, for the run's model and an open-weights baseline
alike: the median of the timed rounds' prefill and decode tokens/s."""

from __future__ import annotations

import statistics

import torch


def speed_record(
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    prefill_s: list[float],
    decode_s: list[float],
    kv_bytes: int | None,
    device: torch.device,
) -> dict:
    """One batch size's timed rounds as the table's row: median tokens/s of prefill and decode."""
    prefill, decode = statistics.median(prefill_s), statistics.median(decode_s)
    return {
        "batch": batch,
        "prefill_tokens_per_s": batch * prompt_tokens / prefill,
        "decode_tokens_per_s": batch * new_tokens / decode,
        "prefill_s": prefill,
        "decode_s": decode,
        "prefill_s_each": prefill_s,
        "decode_s_each": decode_s,  # every timed round: the spread behind the median
        "kv_cache_bytes": kv_bytes,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
