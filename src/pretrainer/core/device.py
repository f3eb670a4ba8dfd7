"""Which device and precision a process computes in, and its peak FLOP/s for MFU.

device = resolve_device("auto")                  # cuda (this rank's local GPU) if available, else cpu
amp_dtype = autocast_dtype("auto", device)       # bf16 autocast on CUDA, None (float32) on CPU
compiled = compiles("auto", device)              # torch.compile per block on CUDA, eager on CPU
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from pathlib import Path

import torch

from pretrainer.core.errors import UserError
from pretrainer.core.hardware import GPUS, gpu_from_device_name


def resolve_device(name: str, local_rank: int = 0, paid: bool = False, world_size: int = 1) -> torch.device:
    """`name` ("auto", "cpu", "cuda", "cuda:N") as a device. paid: a training run, where "auto" on a
    machine with NVIDIA GPUs that torch cannot use (a CPU build, an old driver) is refused rather than
    run on the CPU: eight CPU workers billed as eight GPUs."""
    if paid:
        check_torch_version(torch.__version__)
    if name == "auto":
        if not torch.cuda.is_available() and paid:
            refuse_cpu_fallback()
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device '{name}': not a device here; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device '{name}': pretrainer runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is not None and world_size > 1 and device.index != local_rank:
        raise UserError(
            f"train.device = '{name}' under torchrun puts every rank on GPU {device.index}; use "
            f"--train.device=cuda (each rank takes its own, LOCAL_RANK's, GPU)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train.device = '{name}' but CUDA is not available; use --train.device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


TORCH_FLOOR = (2, 6)  # FSDP2's public fully_shard (torch.distributed.fsdp) arrived in 2.6


def check_torch_version(version: str) -> None:
    """One line instead of a crash deep in FSDP2 or a lost final checkpoint, for a torch below the floor."""
    parts = version.split("+")[0].split(".")
    found = tuple(int(p) if p.isdigit() else 0 for p in parts[:2])
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise UserError(
            f"torch {version} is older than {floor}, which pretrainer's training needs (FSDP2's fully_shard, "
            f"torchrun's shutdown grace); pip install 'torch>={floor}'"
        )


def listed_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (none where it is missing or fails)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        said = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in said.splitlines() if line.startswith("GPU ")]


def refuse_cpu_fallback() -> None:
    """Unless CUDA_VISIBLE_DEVICES is set and empty: GPUs hidden on purpose (a job given none on a GPU
    node)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return
    gpus = listed_gpus()
    if gpus:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise UserError(
            f"train.device = auto: this machine has {len(gpus)} NVIDIA GPU(s) ({gpus[0][:60]}) but {build} "
            f"cannot use CUDA (a CPU build or a driver too old for it): install a CUDA build of torch, or "
            f"pass --train.device=cpu to train on the CPU anyway"
        )


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default, where the GPU has bf16 (not a T4 or V100: float32 there, as
    fp16 would need a loss scaler); plain float32 on CPU (bf16 matmuls there are slow and inexact)."""
    if name == "bfloat16":
        return torch.bfloat16
    if name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return None


def compiles(setting: str, device: torch.device) -> bool:
    """train.compile: "auto" compiles on CUDA (a GPU step's many small kernels fuse) and not on CPU, where
    compile time is not won back; "true"/"false" as given."""
    return setting == "true" or (setting == "auto" and device.type == "cuda")


def uncompiled():
    """Compiled modules run eagerly under this: shapes a run meets once or in many sizes (a partial last
    validation batch, task scoring, generation) compile no graph of their own. The training and
    validation graphs stay static (configure_blocks: dynamic=False), so a run that resumes after them
    compiles what an uninterrupted one did, whatever came first. Where nothing was compiled (dynamo
    never imported) it is a no-op, and costs no import of dynamo either."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def use_deterministic_kernels(on: bool) -> None:
    """train.deterministic, set before the first cuBLAS call: every kernel deterministic (flash attention's
    backward included; cuDNN attention excluded) or an error naming the op; cuBLAS then needs a fixed
    workspace. Off: torch's defaults (a run in this process after a deterministic one is not)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if on or torch.are_deterministic_algorithms_enabled():  # (the call imports inductor: ~1 s a launch)
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


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
        raise UserError(
            f"{purpose} needs torchao: pip install torchao (from the checkout: pip install -e '.[lowbit]')"
        ) from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return torchao


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's data: itself, or a tensor subclass's inner tensors
    (torchao's quantised weights and optimizer moments: codes, scales; an FSDP shard's DTensor: the
    local shard), recursively."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return [plain for i in inner if isinstance(i, torch.Tensor) for plain in plain_tensors(i)]
    return [t]


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds on this device (a subclass: the sum of its inner tensors)."""
    return sum(plain.numel() * plain.element_size() for plain in plain_tensors(t))


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
