"""Which device and precision a process computes in, and its peak FLOP/s for MFU.

device = resolve_device("auto")                  # cuda (this rank's local GPU) if available, else cpu
amp_dtype = autocast_dtype("auto", device)       # bf16 autocast on CUDA, None (float32) on CPU
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from pretrainer.core.errors import UserError
from pretrainer.core.hardware import GPUS, gpu_from_device_name


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device '{name}': not a device here; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device '{name}': pretrainer runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train.device = '{name}' but CUDA is not available; use --train.device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; plain float32 on CPU (bf16 matmuls there are slow and inexact)."""
    if name == "bfloat16" or (name == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """The forward pass's autocast context (a no-op in float32)."""
    return torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)


def device_peak_tflops(configured: float, device: torch.device) -> float | None:
    """Dense bf16 peak per device: the configured value, else the GPU table's; None on CPUs (no MFU)."""
    if configured:
        return configured
    if device.type == "cuda":
        key = gpu_from_device_name(torch.cuda.get_device_name(device))
        return GPUS[key].peak_bf16_tflops if key else None
    return None  # CPUs: no peak we trust, so no MFU


def import_torchao(purpose: str):
    """torchao (the `lowbit` extra), imported for `purpose`, or a one-line UserError saying how to install it.
    Its import logs a warning for each compiled kernel library this torch build cannot load (CUDA-only
    ones on a CPU build) and torch a deprecation note: silenced for the import; nothing here uses them."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.optim
        import torchao.quantization  # noqa: F401 (submodules the callers use)
    except ImportError:
        raise UserError(f"{purpose} needs torchao: pip install 'pretrainer[lowbit]'") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return torchao


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds on this device: a tensor subclass (torchao's quantised weights and optimizer
    moments, an FSDP shard's DTensor) is the sum of its inner tensors (codes, scales, the local shard)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(
            tensor_bytes(inner) for inner in (getattr(t, n) for n in names) if isinstance(inner, torch.Tensor)
        )
    return t.numel() * t.element_size()


def hardware_info(device: torch.device, world_size: int) -> dict:
    info = {
        "device_type": device.type,
        "world_size": world_size,
        "cpu_count": os.cpu_count(),
        "cpu_model": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),  # CPU matmuls' sums split by it: bit-exactness needs the same
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = world_size
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 1e9, 1)
    return info
