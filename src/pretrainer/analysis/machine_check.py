"""Is the machine what you pay for: `plan --measure` times a matmul, a device memory copy and a write to
the run dir's disk, and sets each against the hardware table (a GPU's dense bf16 peak and memory
bandwidth) or, for the disk, against the speed plan assumes for checkpoints. One far below (a throttled
or mis-sold GPU, a slow network disk) is a warning before the budget clock runs. A CPU has no table
figures: its numbers are reported, not judged.

    check = machine_check(Path("runs/x1"))     # {"device", "checks": [...], "warnings": [...]}
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from pretrainer.analysis.costs import ASSUMED_WRITE_BYTES_PER_S
from pretrainer.core.device import resolve_device
from pretrainer.core.hardware import GPUS, gpu_from_device_name

FAR_BELOW = 0.5  # a figure under half its reference is a warning
DISK_BYTES = 128 * 2**20  # past the page cache's write-back: fsync waits for the disk


def _timed(work, device: torch.device, repeats: int) -> float:
    """Seconds per call of `work`, after one untimed call."""
    work()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    _sync(device)
    return (time.perf_counter() - started) / repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device) -> float:
    """A square matmul's achieved TFLOP/s: bf16 on a GPU (what training runs), fp32 on a CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _timed(lambda: a @ b, device, 10) / 1e12


def copy_gbps(device: torch.device) -> float:
    """A device-to-device copy's bandwidth: bytes read plus bytes written, per second."""
    size = 2**30 if device.type == "cuda" else 2**26  # past a CPU's caches
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * size / _timed(lambda: target.copy_(source), device, 5) / 1e9


def disk_write_mbps(run_dir: Path) -> tuple[float, Path]:
    """Writing DISK_BYTES to the run dir's disk (its nearest existing directory), flushed to it."""
    where = Path(run_dir).absolute()
    while not where.is_dir():
        where = where.parent
    path = where / f".pretrainer-disk-check-{os.getpid()}"
    chunk = os.urandom(8 * 2**20)
    try:
        started = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(DISK_BYTES // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    return DISK_BYTES / seconds / 1e6, where


def machine_check(run_dir: Path, device: str = "auto") -> dict:
    dev = resolve_device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    gpu = GPUS.get(gpu_from_device_name(name) or "") if dev.type == "cuda" else None
    tflops, gbps = matmul_tflops(dev), copy_gbps(dev)
    # a CPU's rate in TFLOP/s printed as 0.0: GFLOP/s there
    flops, flops_unit = (tflops, "TFLOP/s") if dev.type == "cuda" else (tflops * 1000, "GFLOP/s")
    try:
        disk, where = disk_write_mbps(run_dir)
    except OSError as e:  # a read-only or full disk: the run would fail at its first checkpoint
        disk, where = 0.0, f"cannot write: {e.strerror or e}"
    checks = [
        {
            "what": "matmul",
            "value": flops,
            "unit": flops_unit,
            "reference": gpu.peak_bf16_tflops if gpu else None,
            "reference_is": "the dense bf16 peak",
        },
        {
            "what": "memory copy",
            "value": gbps,
            "unit": "GB/s",
            "reference": gpu.memory_tbps * 1000 if gpu else None,
            "reference_is": "the memory bandwidth",
        },
        {
            "what": f"disk write ({where})",
            "value": disk,
            "unit": "MB/s",
            "reference": ASSUMED_WRITE_BYTES_PER_S / 1e6,
            "reference_is": "the rate plan assumes for checkpoints",
        },
    ]
    warnings = []
    for check in checks:
        reference = check["reference"]
        check["ratio"] = check["value"] / reference if reference else None
        if check["ratio"] is not None and check["ratio"] < FAR_BELOW:
            warnings.append(
                f"machine check: {check['what']} {check['value']:,.1f} {check['unit']} is "
                f"{check['ratio']:.0%} of {check['reference_is']} ({reference:,.0f} {check['unit']}): "
                + (
                    "a slow disk makes every checkpoint slower (plan --measure timed this one's)"
                    if check["what"].startswith("disk")
                    else "a throttled, shared or mis-sold device"
                )
            )
    return {"device": name, "checks": checks, "warnings": warnings}


def format_check(check: dict) -> list[tuple[str, str]]:
    rows = []
    for c in check["checks"]:
        against = (
            f" = {c['ratio']:.0%} of {c['reference_is']} ({c['reference']:,.0f})"
            if c["ratio"] is not None
            else " (no reference for this device)"
        )
        rows.append((f"  {c['what']}", f"{c['value']:,.1f} {c['unit']}{against}"))
    return [("machine check", check["device"])] + rows
