"""What this machine is, for the first GPU call's record: versions (Python, torch, CUDA, cuDNN, triton,
the driver), the GPU, the SDPA kernel GPT-2 124M's attention runs (bf16 where the GPU has it), and a
large matrix product's TFLOP/s beside the hardware table's peak (MFU against the GPU's own peak too).

    python benchmarks/gpu_env.py        # one line: ENV {...json...}; on CPU the same, with no GPU
"""

from __future__ import annotations

import json
import platform
import subprocess
import time

import torch

from pretrainer.config.load import load_config
from pretrainer.config.resolve import resolve
from pretrainer.core.device import autocast_dtype, device_peak_tflops
from pretrainer.model import Transformer
from pretrainer.model.attention_probe import attention_backend


def versions() -> dict:
    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": None,
        "gpus": 0,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        report.update(
            gpu=p.name,
            gpus=torch.cuda.device_count(),
            capability=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
        )
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            report["driver"] = subprocess.run(
                query, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            report["driver"] = None
    return report


def attention_kernel(device: torch.device) -> str:
    """What SDPA runs for the 124M config's heads (64 wide, 12 of them, 1024 long), as the trainer logs it
    (one block: the probe runs the first block's attention)."""
    overrides = ["--model.vocab_size=256", "--model.n_layer=1"]  # the vocabulary plays no part in it
    cfg = resolve(load_config("configs/gpt2-124m.toml", overrides), 1, None, horizon=False)
    with torch.device(device):
        model = Transformer(cfg.model)
    return attention_backend(model, cfg.model.seq_len, device, autocast_dtype("auto", device))


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """Ten products of two n x n matrices after three warm-ups: 8192 in bf16 on a GPU, 1024 in fp32 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return round(
        10 * 2 * n**3 / (time.perf_counter() - started) / 1e12, 1
    ), f"{n}^3 {str(dtype).split('.')[-1]}"


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = versions()
    report["attention_124m"] = attention_kernel(device)
    report["matmul_tflops"], report["matmul"] = matmul_tflops(device)
    report["table_peak_tflops"] = device_peak_tflops(0, device)
    print("ENV " + json.dumps(report))


if __name__ == "__main__":
    main()
