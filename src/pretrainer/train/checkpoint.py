"""Checkpoints in a running job: `write_checkpoint` (a collective: every rank gathers its shards, rank 0
writes the format of artifacts/checkpoint.py) and `restore_checkpoint` (rank 0 reads, every rank
receives its part), and the RNG states a checkpoint carries."""

from __future__ import annotations

import base64
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrainer.artifacts.checkpoint import load_checkpoint, model_weights, retire_after, save_checkpoint
from pretrainer.core.device import plain_tensors
from pretrainer.core.errors import WriteFault, write_fault
from pretrainer.optim.state_file import state_for_file
from pretrainer.train.cadence import CheckpointCadence
from pretrainer.train.component import Component, Step
from pretrainer.train.distributed import (
    DistEnv,
    broadcast_object,
    check_ranks_in_step,
    full_state,
    gather_objects,
    load_full_state,
    on_rank0,
    wait_for_checkpoint,
)


def _encoded(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decoded(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device | None = None) -> dict:
    """This process's Python, NumPy and torch RNG states, and its own GPU's (`device`) when it has one."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _encoded(torch.get_rng_state()),
    }
    if device is not None and device.type == "cuda":
        state["cuda_device"] = _encoded(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decoded(state["torch"]))
    if "cuda_device" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_decoded(state["cuda_device"]), device)
    elif "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        # older checkpoints: one process's states of every visible GPU
        torch.cuda.set_rng_state_all([_decoded(s) for s in state["cuda"]])


def rank_rng_state(state: dict, rank: int, world_size: int) -> dict:
    """The RNG state this rank resumes with: its own where the checkpoint's world size is this one (each
    rank draws its own dropout masks and its own GPU's stream), else rank 0's (a changed world size does
    not continue bit-exactly anyway)."""
    ranks = state.get("rng_ranks")
    return ranks[rank] if ranks and len(ranks) == world_size else state["rng"]


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time, in a background thread: the GPUs train on while the
    host copy is serialised, hashed, fsynced and renamed into place (each write is whole or absent, as
    before). A write's failure is raised by `wait()`: at the next checkpoint, a rollback or the run's end."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, write: Callable[[], Any]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 (raised in the training thread by wait())
                self.error = e

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def close(self) -> None:  # the run's end, however it ended: the write in flight completes
        self.wait()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def settle_writes(writer: CheckpointWriter | None, env: DistEnv) -> None:
    """A collective: rank 0's checkpoint write in flight, finished; its failure raised on every rank (the
    ranks wait up to ckpt.write_timeout_s, a slow disk not being a hang)."""
    problem = None
    if env.is_main and writer is not None:
        try:
            writer.wait()
        except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
            if env.world_size == 1:
                raise
            problem = (isinstance(e, WriteFault) or write_fault(e) is not None, str(e))
    if env.world_size > 1:
        wait_for_checkpoint(env)
        problem = broadcast_object(problem, env)
    if problem is not None:
        raise WriteFault(problem[1]) if problem[0] else RuntimeError(problem[1])


def write_checkpoint(
    run_dir: Path,
    step: int,
    wrapped: torch.nn.Module,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int,
    env: DistEnv,
    trainer_state: Callable[[], dict],
    keep_best: bool = False,
    writer: CheckpointWriter | None = None,
    wait: bool = True,
) -> None:
    """A collective: every rank gathers full weights and optimizer state, rank 0 writes them with
    trainer_state() (called on rank 0 only, after the gather) and every rank's RNG state. keep_best: the
    lowest-val checkpoint stays beside the newest `keep`. Rank 0 writes in `writer`'s background thread,
    after the previous write has finished; wait=False: training goes on meanwhile (periodic checkpoints);
    wait=True: returns once it is on disk (a stop's, the last one)."""
    writer = writer or CheckpointWriter()
    check_ranks_in_step(step, env)  # never a checkpoint after a failed collective
    settle_writes(writer, env)  # one write at a time; a failed one stops every rank here
    rngs = gather_objects(rng_state(env.device), env)  # each rank's own, taken before the gather below
    full_weights, full_optimizer = full_state(wrapped, optimizer)
    if env.is_main:
        weights = model_weights(model, full_weights)
        state = {**trainer_state(), **({"rng_ranks": rngs} if env.world_size > 1 else {})}
        if not wait:  # the next steps must not change what is written: copy what aliases live host memory
            live = _host_storages(model, optimizer)  # on CPU all of it; on CUDA, e.g. torchao's step counts
            weights, full_optimizer = _copied(weights, live), _copied(state_for_file(full_optimizer), live)
        writer.start(
            lambda: save_checkpoint(
                run_dir, step, weights, full_optimizer, state, keep=keep, keep_best=keep_best
            )
        )
    if wait:
        settle_writes(writer, env)


class Checkpointing(Component):
    """The trainer's checkpoints: when they fall (train/cadence.py: every ckpt.every steps, or auto's
    Young/Daly interval from measured times; and the last step), the writes in rank 0's background
    thread, the time each cost the training thread (metrics.jsonl's checkpoint_s)."""

    name = "checkpointing"

    def __init__(self, trainer, cadence: CheckpointCadence):
        self.trainer, self.cadence, self.writer = trainer, cadence, CheckpointWriter()

    @classmethod
    def build(cls, trainer) -> Checkpointing:
        cfg = trainer.cfg
        cadence = CheckpointCadence(
            cfg.ckpt.every,
            cfg.ckpt.interruptions_per_hour,
            trainer.state.step + 1,
            env=trainer.env,
            log=trainer.run_log.write,
            align=cfg.eval.every if cfg.ckpt.keep_best else 1,  # the best is ranked by a validation there
        )
        return cls(trainer, cadence)

    def save(self, wait: bool = True) -> float:
        """A collective: every rank gathers, rank 0 writes. -> the training thread's seconds on it."""
        trainer = self.trainer
        state, clock, cfg = trainer.state, trainer.run_clock, trainer.cfg
        started = clock.elapsed()
        write_checkpoint(
            trainer.run_dir,
            state.step,
            trainer.wrapped,
            trainer.model,
            trainer.optimizer,
            keep=cfg.ckpt.keep,
            env=trainer.env,
            trainer_state=trainer.state_json,
            keep_best=cfg.ckpt.keep_best,
            writer=self.writer,
            wait=wait,
        )
        state.saved_step = state.step
        # what the training thread spent on it (plan --from-run counts checkpoints with it)
        took = clock.elapsed()
        trainer.run_log.write({"step": state.step, "checkpoint_s": took - started, "elapsed_s": took})
        return took - started

    def settle(self) -> None:
        """A write in flight, finished (a collective)."""
        settle_writes(self.writer, self.trainer.env)

    def after_log(self, step: Step) -> None:
        if step.record is not None:
            tokens_per_s = step.record["tokens_per_s"]
            step_tokens = self.trainer.start.step_tokens
            self.cadence.measured_step(step_tokens / tokens_per_s if tokens_per_s > 0 else 0)

    def between_steps(self, step: Step) -> bool:
        if not (self.cadence.due(step.number) or step.last):
            return False
        # periodic: written as training goes on; the last one waited for
        self.cadence.checkpointed(step.number, self.save(wait=step.last))
        return True

    def close(self) -> None:
        self.writer.close()  # the write in flight completes, however the run ended


def _host_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The data pointers of every host tensor the model and optimizer hold (a quantised moment's parts
    too): a gathered state dict may return these very tensors, which the next step updates in place."""
    found: set[int] = set()

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            found.update(
                t.untyped_storage().data_ptr() for t in plain_tensors(value) if t.device.type == "cpu"
            )
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for tensor in [*model.parameters(), *model.buffers()]:
        visit(tensor)
    for state in optimizer.state.values():
        visit(state)
    return found


def _copied(value, live: set[int]):
    """A (nested) state dict with a copy of every tensor that shares its storage with a `live` one."""
    if isinstance(value, torch.Tensor):
        aliased = value.device.type == "cpu" and value.untyped_storage().data_ptr() in live
        return value.clone() if aliased else value
    if isinstance(value, dict):
        return {k: _copied(v, live) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v, live) for v in value)
    return value


def restore_checkpoint(
    path: Path,
    wrapped: torch.nn.Module,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
) -> dict:
    """Roll back: a checkpoint (verified when it was picked, read on rank 0) into a running, possibly
    wrapped or sharded model and its optimizer; every rank receives its part. Newer checkpoints belong
    to the abandoned trajectory and are deleted, so a later resume cannot pick them. -> the
    checkpoint's trainer state."""

    def read() -> tuple[dict, dict, dict]:
        loaded = load_checkpoint(path)
        retire_after(path.parent.parent, loaded[2]["step"], "rolled-back")
        return loaded

    weights, optimizer_state, state = on_rank0(read, env, f"{path}: cannot roll back to it") or (
        None,
        None,
        None,
    )
    load_full_state(wrapped, model, optimizer, weights=weights, optimizer_state=optimizer_state, env=env)
    return broadcast_object(state, env)
