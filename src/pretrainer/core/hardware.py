"""The hardware table: peak dense bf16 TFLOP/s per GPU (REFERENCE_NUMBERS), lookups by name or by
the device name CUDA reports, and the arithmetic on it: training time at an MFU, and MFU from a
measured throughput."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# GPU matmuls run at full rate when their sizes are multiples of this (tensor cores' tiles): the vocabulary is
# padded to it, loss chunks rounded to it
MATMUL_ALIGNMENT = 128


# --- GPUs: dense bf16 peak (no sparsity), memory, board power ---


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_tflops: float
    memory_gb: float
    board_power_w: float
    memory_tbps: float  # memory bandwidth, TB/s (the vendor's data sheet)


GPUS = {
    "a100-40gb": GPU("NVIDIA A100 40GB", 312, 40, 400, 1.555),
    "a100-80gb": GPU("NVIDIA A100 80GB", 312, 80, 400, 2.039),
    "h100-sxm": GPU("NVIDIA H100 SXM", 989, 80, 700, 3.35),
    "h100-pcie": GPU("NVIDIA H100 PCIe", 756, 80, 350, 2.0),
    "h200": GPU("NVIDIA H200", 989, 141, 700, 4.8),
    "b200": GPU("NVIDIA B200", 2250, 192, 1000, 8.0),
    "l4": GPU("NVIDIA L4", 121, 24, 72, 0.3),
    "l40s": GPU("NVIDIA L40S", 362, 48, 350, 0.864),
    "rtx-3090": GPU("NVIDIA GeForce RTX 3090", 71, 24, 350, 0.936),
    "rtx-4090": GPU("NVIDIA GeForce RTX 4090", 165, 24, 450, 1.008),
    "a10": GPU("NVIDIA A10", 125, 24, 150, 0.6),
}
ALIASES = {
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-sxm",
    "rtx3090": "rtx-3090",
    "rtx4090": "rtx-4090",
}


def lookup_gpu(name: str) -> GPU | None:
    key = name.strip().lower()
    return GPUS.get(ALIASES.get(key, key))


def gpu_from_device_name(device_name: str) -> str | None:
    """torch.cuda.get_device_name() -> a GPUS key, or None for a device we do not know (no MFU then)."""
    n = device_name.upper()
    rules = [
        ("B200", "b200"),
        ("H200 NVL", None),  # its own (lower) peak: no MFU rather than the SXM part's
        ("H200", "h200"),
        ("H100 NVL", None),
        ("H100", "h100-pcie" if "PCIE" in n else "h100-sxm"),
        ("A100", "a100-40gb" if "40GB" in n else "a100-80gb"),
        ("L40S", "l40s"),
        ("L40", None),
        ("4090", "rtx-4090"),
        ("3090", "rtx-3090"),
        ("L4", "l4"),
        ("A10", "a10"),
    ]
    for (
        needle,
        key,
    ) in rules:  # order matters: "A100" contains "A10", "L40S" and "L40" contain "L4"; None: not in
        # the table (H100 NVL and L40 have their own peaks), so no MFU rather than a wrong one
        if needle in n:
            return key
    return None


def training_seconds(total_flops: float, gpus: int, peak_tflops: float, mfu: float) -> float:
    """Wall time for `total_flops` on `gpus` GPUs of `peak_tflops` each, at model FLOPs utilisation `mfu`."""
    return total_flops / (gpus * peak_tflops * 1e12 * mfu)


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, n_gpus: int) -> float:
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * n_gpus)


# --- instance types: what `plan --compare` ranks. Prices are listed prices per GPU-hour, for defaults
# only (docs/planning.md gives each one's source and date); `plan --prices FILE` replaces or adds rows ---


@dataclass(frozen=True)
class Instance:
    name: str
    gpu: str  # a GPUS key
    count: int
    usd_per_gpu_hour: float
    source: str


INSTANCES = [
    Instance("runpod-1x-a100-80gb", "a100-80gb", 1, 0.79, "X1 lab 00: RunPod community"),
    Instance("lambda-1x-a100-80gb-spot", "a100-80gb", 1, 1.10, "X1 lab 00: Lambda spot"),
    Instance("lambda-8x-a100-40gb", "a100-40gb", 8, 1.29, "DDP story: Lambda, $10.32/h"),
    Instance("lambda-8x-a100-80gb", "a100-80gb", 8, 1.79, "DDP story: Lambda, $14.32/h"),
    Instance("lambda-2x-h100-sxm", "h100-sxm", 2, 3.19, "DDP story: Lambda, $6.38/h"),
    Instance("lambda-8x-h100-sxm", "h100-sxm", 8, 2.99, "DDP story: Lambda, $23.92/h"),
    Instance("1x-h200", "h200", 1, 3.60, "REFERENCE_NUMBERS: low end, 2025-26"),
    Instance("lambda-8x-b200", "b200", 8, 4.99, "DDP story: Lambda, $39.92/h"),
    Instance("1x-rtx-4090", "rtx-4090", 1, 0.34, "REFERENCE_NUMBERS: low end, 2025-26"),
]


# --- CPUs: the cores other processes keep busy ---


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity: a SLURM or taskset allocation); None where the
    platform cannot say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """How many cores this process may run on."""
    cpus = allowed_cpus()
    return len(cpus) if cpus else os.cpu_count() or 1


def cores_busy_elsewhere(seconds: float = 0.3) -> float | None:
    """How many of this process's usable cores other processes kept busy over `seconds`, from Linux's
    /proc (this process's own time left out; load on cores outside its allocation, another job's on a
    shared node, does not count); None where there is no /proc."""
    cpus = allowed_cpus()

    def reading() -> tuple[int, int, int, int]:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
        mine = [row for row in rows[1:] if cpus is None or int(row[0][3:]) in cpus]
        # (no per-CPU lines for these CPUs, as where /proc is renumbered: the first line, every CPU's sum)
        jiffies = [[int(v) for v in row[1:9]] for row in mine or rows[:1]]
        counted = len(mine) or len(cpus or ()) or os.cpu_count() or 1  # (the sum's busy share of ours)
        with open("/proc/self/stat") as f:
            own = sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:15])  # utime .. cstime
        # all, idle + iowait, this process's, cores counted
        return sum(map(sum, jiffies)), sum(j[3] + j[4] for j in jiffies), own, counted

    try:
        before = reading()
        time.sleep(seconds)
        after = reading()
    except (OSError, ValueError, IndexError):
        return None
    total, idle, own = (b - a for a, b in zip(before[:3], after[:3]))
    if total <= 0:
        return None
    return max(0.0, (total - idle - own) / total * after[3])
