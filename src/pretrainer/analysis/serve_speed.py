"""One batch size's serving speed, timed the same way for the run's model and an open-weights baseline:
rounds of a prefill then greedy decode steps (synchronised on CUDA), the warm-up ones untimed, and the
table's row from the medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def speed_record(
    *,
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(
    prefill: Callable[[], Any],
    decode_step: Callable[[Any], Any],
    *,
    new_tokens: int,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """-> (prefill seconds, decode seconds) of each timed round. `prefill()` returns the decoding state
    (the cache and the next token); `decode_step(state)` the state after one more token."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prefill_s, decode_s = [], []
    for round_ in range(warmup + repeats):
        sync(device)
        started = time.perf_counter()
        state = prefill()
        sync(device)
        prefilled = time.perf_counter()
        for _ in range(new_tokens):
            state = decode_step(state)
        sync(device)
        if round_ >= warmup:
            prefill_s.append(prefilled - started)
            decode_s.append(time.perf_counter() - prefilled)
    return prefill_s, decode_s


def priced(speed: dict, usd_per_hour: float) -> dict:
    """The row with $ per million generated and prompt tokens: the device rented whole, kept busy."""
    speed["usd_per_million_generated"] = usd_per_hour / 3600 / speed["decode_tokens_per_s"] * 1e6
    speed["usd_per_million_prompt"] = usd_per_hour / 3600 / speed["prefill_tokens_per_s"] * 1e6
    return speed
