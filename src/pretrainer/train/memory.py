"""What a training step will allocate, per device, from the config alone: what `pretrainer plan` prints
and what the trainer checks before it allocates anything (a shape that cannot fit is refused in one
line instead of meeting the kernel's OOM killer or an allocator traceback).

Memory per GPU (bytes; P parameters, M of them in matmuls; sharded over the GPUs under FSDP,
replicated under DDP), everything the trainer allocates:
  weights 4P (fp32 master), gradients 4P (DDP keeps them in its all-reduce buckets:
  gradient_as_bucket_view, no second copy), the optimizer's state (AdamW's fp32 moments 8P, or the
  8-/4-bit moments' real bytes tensor by tensor: train/optim.planned_state_bytes), ~1.5 GiB of CUDA context;
  bf16 autocast keeps a bf16 copy of each matmul weight for the backward (2M; under FSDP the
  all-gathered bf16 weights instead, two blocks at a time with prefetch);
  the fused loss (model/loss.py) keeps the output projection's fp32 gradient (4 x vocab x d) from
  the forward to the backward, and makes logits one chunk at a time (6 bytes x LOSS_CHUNK_ELEMENTS,
  plus the bf16 weight and one bf16 weight-gradient product, 4 x vocab x d): no full logits, ever;
  on logging steps the update/param ratio needs ~8 bytes x the largest parameter, after the
  backward (when activations are gone): it counts only if it exceeds them.
  Activations saved for the backward, per token in bf16 autocast (d = d_model, k = KV width,
  f = d_ff, h = heads), per layer: llama 30d + 4k + 8f + 4h + 8, gpt2 24d + 4f + 4h + 16 (the fp32
  residual stream and norm inputs, bf16 matmul inputs, q/k/v and the attention output with
  flash/SDPA: no score matrix, the MLP tensors); after the layers 10d + 12 (llama) or 6d + 16.
  With activation checkpointing per block only each block's fp32 input (4d) is kept, and one
  block is recomputed at a time. The coefficients are measured (tests/test_gpu_ready.py checks
  them against the tensors a CPU step really saves, within 10%).
These are estimates to choose a micro-batch; the trainer logs the measured peak.
"""

from __future__ import annotations

import os

import torch

from pretrainer.config.resolve import resolve_d_ff, uses_qk_norm
from pretrainer.config.schema import Config
from pretrainer.core.errors import UserError
from pretrainer.model import Transformer, count_parameters
from pretrainer.model.loss import LOSS_CHUNK_ELEMENTS
from pretrainer.optim.muon import hidden_flags
from pretrainer.optim.registry import optimizer_entry, optimizer_flops_per_step
from pretrainer.optim.sizes import planned_state_bytes

CUDA_OVERHEAD_BYTES = int(1.5 * 2**30)
# the trainer refuses only a plan this far over the device's memory: the plan is an estimate (its
# activation coefficients are measured within 10%), and a refusal has no override
FIT_MARGIN = 1.25


def activation_bytes_per_token(cfg: Config) -> dict:
    m = cfg.model
    d, h, f = m.d_model, m.n_head, resolve_d_ff(m)
    kv = (m.n_kv_head or m.n_head) * (d // m.n_head)
    if m.arch == "llama":
        per_layer, after_layers = 30 * d + 4 * kv + 8 * f + 4 * h + 8, 10 * d + 12
        if uses_qk_norm(m):  # the normed queries and keys, and their inputs kept for the norm's backward
            per_layer += 6 * d + 4 * kv
    else:
        per_layer, after_layers = 24 * d + 4 * f + 4 * h + 16, 6 * d + 16
    return {
        "full": m.n_layer * per_layer + after_layers,
        "checkpointed": m.n_layer * 4 * d + per_layer + after_layers,
    }


def fsdp_shards(cfg: Config, gpus: int, gpus_per_node: int) -> int:
    """How many ways FSDP2 splits the weights, gradients and optimizer state: the GPUs of one node when
    a run spans nodes (HSDP, parallel.fsdp_shard = node), else every GPU."""
    if cfg.parallel.fsdp_shard == "node" and gpus > gpus_per_node and gpus % gpus_per_node == 0:
        return gpus_per_node
    return gpus


def memory_per_gpu(
    cfg: Config,
    params: int,
    matmul_params: int,
    param_shapes: list[tuple[int, ...]],
    *,
    gpus: int,
    strategy: str,
    gpu_memory_gb: float | None,
    gpus_per_node: int = 8,
    hidden: list[bool] | None = None,
) -> dict:
    """Bytes per GPU at the step's peak, item by item (see the module docstring), for the configured
    micro-batch, with and without activation checkpointing."""
    m = cfg.model
    shards = fsdp_shards(cfg, gpus, gpus_per_node) if strategy == "fsdp" and gpus > 1 else 1
    block_params = (matmul_params - m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)) / max(
        m.n_layer, 1
    )
    out = {
        "weights": 4 * params // shards,
        "gradients": 4 * params // shards,
        "optimizer": planned_state_bytes(optimizer_entry(cfg.optim.name), param_shapes, shards, hidden),
        "ddp_buckets": 0,  # gradient_as_bucket_view: the gradients are the buckets
        "bf16_weights": int(2 * 2 * block_params)
        if shards > 1
        else 2 * matmul_params,  # FSDP: 2 gathered blocks
        "loss_gradient": 4 * m.vocab_size * m.d_model,
        # one chunk of logits (bf16 + fp32), the bf16 weight, the chunk's bf16 weight-gradient product
        "loss_chunk": 6 * min(LOSS_CHUNK_ELEMENTS, m.vocab_size * cfg.train.micro_batch * m.seq_len)
        + 4 * m.vocab_size * m.d_model,
        "cuda_overhead": CUDA_OVERHEAD_BYTES,
    }
    states = out["weights"] + out["gradients"] + out["optimizer"] + out["cuda_overhead"]
    largest = m.vocab_size * m.d_model  # the token embedding
    logging_peak = states + 8 * largest // shards
    per_token = activation_bytes_per_token(cfg)
    tokens = cfg.train.micro_batch * m.seq_len
    fixed = states + out["bf16_weights"] + out["loss_gradient"] + out["loss_chunk"]
    for key, name in (("full", ""), ("checkpointed", "_checkpointed")):
        out[f"activations{name}"] = per_token[key] * tokens
        out[f"total{name}"] = max(fixed + out[f"activations{name}"], logging_peak)
        if gpu_memory_gb:
            out[f"max_micro_batch{name}"] = max(
                0, int((gpu_memory_gb * 1e9 - fixed) // (per_token[key] * m.seq_len))
            )
    if gpu_memory_gb:
        out["fits"] = out["total"] <= gpu_memory_gb * 1e9
        out["fits_checkpointed"] = out["total_checkpointed"] <= gpu_memory_gb * 1e9
    return out


def matmul_parameter_count(model: Transformer) -> int:
    """Parameters that enter matmuls (autocast keeps a bf16 copy of each): the Linear weights, the
    output projection included (tied or not)."""
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def planned_memory(
    cfg: Config, world_size: int, memory_gb: float | None = None, gpus_per_node: int = 8
) -> tuple[dict, dict]:
    """-> (parameter counts, memory_per_gpu's items) for a resolved config, the model built on the meta
    device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
        counts, matmul_params = count_parameters(model), matmul_parameter_count(model)
        # tied weights once, as the optimizer holds them
        param_shapes = [tuple(p.shape) for p in model.parameters()]
        hidden = hidden_flags(model)  # the matrices Muon keeps one buffer for
        counts["optimizer_flops_per_step"] = optimizer_flops_per_step(cfg.optim.name, model)
    memory = memory_per_gpu(
        cfg,
        counts["total"],
        matmul_params,
        param_shapes,
        gpus=world_size,
        strategy=cfg.parallel.strategy,
        gpu_memory_gb=memory_gb,
        gpus_per_node=gpus_per_node,
        hidden=hidden,
    )
    # what a checkpoint writes: the whole fp32 model and optimizer state, however it is sharded
    counts["checkpoint_bytes"] = 4 * counts["total"] + planned_state_bytes(
        optimizer_entry(cfg.optim.name), param_shapes, 1, hidden
    )
    return counts, memory


def device_memory_bytes(device: torch.device) -> int:
    """What one device holds: a GPU's memory, or this machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def upper_bound_bytes(cfg: Config) -> int:
    """More than memory_per_gpu's total, from the shape alone (building even a meta-device model costs
    seconds of imports in a fresh process): every parameter counted as a matmul weight of the widest
    architecture, untied, with 20 bytes each (fp32 weight, gradient, two moments, a bf16 copy)."""
    m = cfg.model
    d, f, vocab = m.d_model, resolve_d_ff(m), m.vocab_size
    params = m.n_layer * (4 * d * d + 3 * d * f + 4 * d) + 2 * vocab * d + m.seq_len * d
    tokens = cfg.train.micro_batch * m.seq_len
    loss = 6 * LOSS_CHUNK_ELEMENTS + 8 * vocab * d
    return 20 * params + activation_bytes_per_token(cfg)["full"] * tokens + loss + CUDA_OVERHEAD_BYTES


def refuse_what_cannot_fit(
    cfg: Config, world_size: int, device: torch.device, gpus_per_node: int = 8
) -> None:
    """One line, before anything is allocated, for a run whose planned peak is well over the device's
    whole memory (--model.d_model=1000000, --model.seq_len=100000000): FIT_MARGIN x, since the plan is an
    estimate; the trainer logs the measured peak."""
    available = device_memory_bytes(device)
    if upper_bound_bytes(cfg) <= FIT_MARGIN * available:  # the common case, without building a model
        return
    _, memory = planned_memory(cfg, world_size, gpus_per_node=gpus_per_node)
    key = "total_checkpointed" if cfg.train.activation_checkpointing else "total"
    planned = memory[key] - (CUDA_OVERHEAD_BYTES if device.type != "cuda" else 0)
    if planned > FIT_MARGIN * available:
        raise UserError(
            f"config: this run needs about {planned / 1e9:,.1f} GB per device at its peak (weights, "
            f"gradients, optimizer, activations of micro_batch {cfg.train.micro_batch} x seq_len "
            f"{cfg.model.seq_len}) and {device} has {available / 1e9:,.1f} GB; make model.d_model, "
            f"model.n_layer, model.seq_len or train.micro_batch smaller (`pretrainer plan` itemises it)"
        )
