"""Which device a run trains on: never the CPU by accident on a GPU machine, never an old torch."""

from __future__ import annotations

import os

import pytest
import torch

from pretrainer.core.device import check_torch_version, resolve_device
from pretrainer.core.errors import UserError
from pretrainer.optim.adamw import adamw_update_norm


@pytest.fixture
def gpu_machine(tmp_path, monkeypatch):
    """A machine whose nvidia-smi lists a GPU that this (CPU) torch cannot use."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # conftest hides GPUs from CPU tests


def test_auto_never_falls_back_to_the_cpu_on_a_gpu_machine(gpu_machine, monkeypatch):
    with pytest.raises(UserError, match=r"1 NVIDIA GPU\(s\) \(GPU 0: NVIDIA H100.*--train.device=cpu"):
        resolve_device("auto", paid=True)
    assert resolve_device("cpu", paid=True).type == "cpu"  # said explicitly: the CPU it is
    assert resolve_device("auto").type == "cpu"  # sample, eval: no money at stake
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose: the CPU is what was asked for
    assert resolve_device("auto", paid=True).type == "cpu"


def test_auto_is_the_cpu_where_there_is_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert resolve_device("auto", paid=True).type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_an_old_torch_is_one_line():
    with pytest.raises(UserError, match=r"torch 2.5.1\+cu121 is older than 2.6.*pip install 'torch>=2.6'"):
        check_torch_version("2.5.1+cu121")
    for version in ("2.6.0", "2.13.0+cpu", "2.14.0a0+git1234", torch.__version__):
        check_torch_version(version)


def test_the_update_norm_of_a_first_skipped_step_is_where_the_weights_are():
    """No optimizer state yet (low-bit AdamW skipped step 1): the zero norm is on the weights' device,
    not a CPU tensor that fails when logged beside CUDA ones."""
    weight = torch.nn.Parameter(torch.ones(4, device="meta"))
    norm = adamw_update_norm(torch.optim.AdamW([weight]))
    assert norm.device == weight.device and norm.shape == ()


def test_auto_precision_is_float32_on_a_gpu_without_bf16(monkeypatch):
    """A T4 or V100 (no bf16): float32, not a bf16 autocast the GPU emulates slowly or not at all."""
    from pretrainer.core.device import autocast_dtype

    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it here
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert autocast_dtype("auto", cuda) is None and autocast_dtype("bfloat16", cuda) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert autocast_dtype("auto", cuda) is torch.bfloat16
    assert autocast_dtype("auto", torch.device("cpu")) is None


def test_one_gpu_index_for_every_rank_is_refused():
    with pytest.raises(UserError, match=r"train.device = 'cuda:0' under torchrun puts every rank on GPU 0"):
        resolve_device("cuda:0", local_rank=1, world_size=2)


def test_an_h200_nvl_is_not_priced_as_the_sxm_part():
    from pretrainer.core.hardware import gpu_from_device_name

    assert gpu_from_device_name("NVIDIA H200 NVL") is None and gpu_from_device_name("NVIDIA H200") == "h200"


def test_deterministic_kernels_are_switched_on_and_back_off(monkeypatch):
    """train.deterministic: deterministic algorithms (an op without one raises) and cuBLAS's fixed
    workspace, set before the first cuBLAS call; a later run in the process without it gets the defaults."""
    from pretrainer.core.device import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
