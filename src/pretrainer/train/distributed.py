"""Multi-process training under torchrun: the process group, DDP / FSDP2 wrapping, and the few
collectives the loop needs. Only this module initialises or inspects the process group.

    torchrun --standalone --nproc_per_node=8 -m pretrainer train CONFIG ...
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m pretrainer train
    CONFIG ...

Backend from the device: NCCL on CUDA, gloo on CPU (how the test suite runs 2 ranks without GPUs).
Checkpoints hold *full* (unsharded) weights and optimizer state keyed by parameter name, gathered
on rank 0 with torch.distributed.checkpoint's state-dict API, so a checkpoint written under any
strategy and world size loads under any other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pretrainer.core.device import resolve_device
from pretrainer.core.errors import UserError

STRATEGIES = ("ddp", "fsdp")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control_group: Any = None  # host-side (gloo) group for the loop's per-step flags; None: the default group
    checkpoint_group: Any = None  # host-side (gloo), waits ckpt.write_timeout_s for rank 0's disk
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size if self.world_size % self.local_world_size == 0 else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_gloo_interfaces(nccl_interfaces: str) -> None:
    """gloo's groups use the interfaces NCCL was told to, where NCCL_SOCKET_IFNAME names them exactly:
    NCCL reads a name as a prefix (eth: eth0, eth1) or an exclusion (^docker), gloo only exact names."""
    import socket

    names = [name.strip() for name in nccl_interfaces.split(",") if name.strip()]
    present = {name for _, name in socket.if_nameindex()}
    if names and all(name in present for name in names):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ",".join(names))


def init_distributed(device_name: str, timeout_s: float, checkpoint_timeout_s: float = 3600.0) -> DistEnv:
    """Read torchrun's environment; start the process group when there is more than one rank.
    timeout_s: a collective's hang timeout; checkpoint_timeout_s: the wait for rank 0's checkpoint write."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    default_gloo_interfaces(os.environ.get("NCCL_SOCKET_IFNAME", ""))
    device = resolve_device(device_name, local_rank, paid=True, world_size=world_size)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if (
            backend == "nccl"
        ):  # a hung collective must raise here (-> exit 3 with the hint), not be torn down by the
            # NCCL watchdog (mode 3, the default): mode 2 aborts the communicator only. A user's setting wins.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    control_group = None
    # flags agreed on the host: no CUDA stream, so no device sync
    if world_size > 1 and device.type == "cuda":
        control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    checkpoint_group = (
        dist.new_group(backend="gloo", timeout=timedelta(seconds=checkpoint_timeout_s))
        if world_size > 1
        else None
    )
    return DistEnv(rank, world_size, local_rank, device, control_group, checkpoint_group, local_world_size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def wait_for_checkpoint(env: DistEnv) -> None:
    """Every rank waits for rank 0's checkpoint write, up to ckpt.write_timeout_s: a slow disk is not a
    hang (under the hang timeout, one would end the run as exit 3)."""
    if env.world_size > 1:
        dist.barrier(group=env.checkpoint_group)


def check_ranks_in_step(step: int, env: DistEnv) -> None:
    """Before a checkpoint: one all-reduce, waited for, on the group the gradients use, and every rank at
    `step`. NCCL's error handling (mode 2) aborts a failed collective's communicator and lets the rank go
    on; the error surfaces at its next collective. A DDP checkpoint needs no other collective before rank
    0 writes, so without this one it could save weights stepped with half-reduced gradients."""
    if env.world_size == 1:
        return
    steps = torch.tensor([step, -step], device=env.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # raises on an aborted communicator or a lost rank
    highest, lowest = steps[0].item(), -steps[1].item()
    if highest != lowest:
        raise RuntimeError(f"ranks are at steps {lowest} to {highest} at a checkpoint: no checkpoint written")


def fsdp_layout(env: DistEnv, fsdp_shard: str) -> tuple[int, int]:
    """(replicas, shards) of FSDP2's mesh: a run over several nodes shards within each node and
    replicates across them (HSDP) unless parallel.fsdp_shard = all."""
    if fsdp_shard == "node" and env.nodes > 1:
        return env.nodes, env.local_world_size
    return 1, env.world_size


def strategy_name(strategy: str, env: DistEnv, fsdp_shard: str) -> str:
    """For the start-up line: ddp, fsdp, or hsdp (N nodes x M shards)."""
    if strategy != "fsdp":
        return strategy
    replicas, shards = fsdp_layout(env, fsdp_shard)
    return f"hsdp ({replicas} replicas x {shards} shards)" if replicas > 1 else "fsdp"


def wrap_model(
    model: nn.Module, strategy: str, env: DistEnv, amp_dtype: torch.dtype | None, fsdp_shard: str = "node"
) -> nn.Module:
    """DDP: one replica per rank, gradients all-reduced. FSDP2: each block, then the root, sharded
    with fully_shard (torchtitan's order); bf16 compute with fp32 reduction when autocasting. Over
    several nodes FSDP2 shards within a node and replicates across nodes (fsdp_layout): every
    all-gather and reduce-scatter stays on the node; only the gradient all-reduce crosses the network."""
    if env.world_size == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # gradients live in the all-reduce buckets (no second copy: 4 bytes per parameter saved). They exist
        # from the start and are zeroed, never set to None (loop: keep_grads), so grad-accumulation
        # micro-steps under no_sync() accumulate into the buckets too. The RoPE tables are the same on
        # every rank, so buffers are not re-broadcast before every forward.
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replicas, shards = fsdp_layout(env, fsdp_shard)
    mesh = (
        init_device_mesh(env.device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
        if replicas > 1
        else init_device_mesh(env.device.type, (env.world_size,))
    )
    policy = (
        MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
        if amp_dtype
        else MixedPrecisionPolicy()
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def keep_grads(strategy: str, env: DistEnv) -> bool:
    """zero_grad(set_to_none=...) : False under DDP, whose gradients are views into its buckets."""
    return env.world_size > 1 and strategy == "ddp"


def gradient_sync(wrapped: nn.Module, strategy: str, env: DistEnv, sync: bool):
    """Context for one micro-step. DDP all-reduces on the last one only. FSDP2 reduce-scatters every
    micro-step: skipping it would keep a full unsharded fp32 gradient per GPU between micro-steps
    (+4 bytes per parameter, 4.6 GiB at 1.2B), the memory FSDP is chosen to save and plan counts sharded;
    the reduce-scatters overlap the backward. Across nodes (HSDP) the all-reduce between replicas waits
    for the last micro-step."""
    if env.world_size == 1:
        return contextlib.nullcontext()
    if strategy == "fsdp":  # HSDP: the all-reduce across nodes once per step, on the reduce-scattered shards
        wrapped.set_requires_all_reduce(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else wrapped.no_sync()


def mean_across_ranks(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # SUM then divide: gloo has no AVG
    return value / env.world_size


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. FSDP2's gradient norm) as a plain tensor; plain tensors pass through."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded weights and name-keyed optimizer state on CPU, on rank 0 (empty dicts elsewhere).
    A collective: every rank must call it."""
    # imported here: torch.distributed.checkpoint costs seconds of start-up that plan, eval, sample and
    # every other verb that never saves a trainer's state would pay
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(wrapped, options=options), get_optimizer_state_dict(
        wrapped, optimizer, options=options
    )


def load_full_state(
    wrapped: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    weights: dict | None,
    optimizer_state: dict | None,
    env: DistEnv,
) -> None:
    """Full (unsharded, name-keyed) weights and optimizer state, held by rank 0 only, into a model
    that may be wrapped or sharded: rank 0 broadcasts tensor by tensor and each rank keeps its part,
    so no other rank ever holds the full state in host memory. Written by any strategy and world size."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if env.world_size == 1:
        model.load_state_dict(weights, strict=False)  # strict=False: tied aliases are stored once
        if optimizer is not None:
            set_optimizer_state_dict(
                wrapped,
                optimizer,
                optim_state_dict=optimizer_state,
                options=StateDictOptions(full_state_dict=True),
            )
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(wrapped, weights if env.is_main else {}, options=options)
    if optimizer is not None:
        # DDP's gradients are its bucket views (wrap_model). The state-dict API takes existing gradients to
        # mean "optimizer state already initialised" and, when it initialises, sets them to None: step aside.
        grads = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        if getattr(optimizer, "quantised_state", False):
            # torchao's quantised moments have no broadcast: rank 0's plain parts go to every rank as one
            # object
            # (DDP only, optim/lowbit.py: each rank holds the whole state anyway), rebuilt and loaded there
            from pretrainer.optim.state_file import state_for_file, state_from_file

            full = state_from_file(
                broadcast_object(state_for_file(optimizer_state) if env.is_main else None, env)
            )
            set_optimizer_state_dict(
                wrapped, optimizer, optim_state_dict=full, options=StateDictOptions(full_state_dict=True)
            )
        else:
            set_optimizer_state_dict(
                wrapped,
                optimizer,
                optim_state_dict=optimizer_state if env.is_main else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad


def broadcast_object(value, env: DistEnv):
    """Rank 0's (picklable) value on every rank."""
    if env.world_size == 1:
        return value
    box = [value if env.is_main else None]
    dist.broadcast_object_list(box, src=0, group=env.control_group)  # pickled through host memory (gloo)
    return box[0]


def gather_objects(value, env: DistEnv) -> list:
    """Every rank's (picklable) value, in rank order, on every rank."""
    if env.world_size == 1:
        return [value]
    values = [None] * env.world_size
    dist.all_gather_object(values, value, group=env.control_group)
    return values


def on_rank0(work: Callable[[], Any], env: DistEnv, where: str) -> Any:
    """work() on rank 0 only -> its result there, None elsewhere. A failure is raised on every rank as
    one UserError line, so no rank waits in a collective for one that gave up."""
    result, problem, kind = None, "", UserError
    if env.is_main:
        try:
            result = work()
        except Exception as e:
            problem = str(e) if isinstance(e, UserError) else f"{where} ({type(e).__name__}: {e})"
            kind = type(e) if isinstance(e, UserError) else UserError  # NotThisRun stays itself
    problem, kind = broadcast_object((problem, kind), env)
    if problem:
        raise kind(problem)
    return result


def agree_max(values: list[int], env: DistEnv) -> list[int]:
    """Element-wise largest over ranks (a stop request seen by any rank stops all of them).

    The flags live in host memory and go through a gloo group, never through the GPU: the call
    blocks this rank's host until every rank's host arrives, but never waits for queued GPU work,
    so the loop can call it every step without a device->host sync."""
    if env.world_size == 1:
        return [int(v) for v in values]
    flags = np.asarray(values, dtype=np.int64)
    # in place, into `flags`
    dist.all_reduce(torch.from_numpy(flags), op=dist.ReduceOp.MAX, group=env.control_group)
    return flags.tolist()
