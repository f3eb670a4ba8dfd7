"""What the training speed depends on, measured while the run trains: host syncs, time spent waiting
for data, and the throughput watchdog (the attention kernel SDPA really picks: model/attention_probe.py).

    speed = SpeedMonitor.build(trainer)         # a trainer component (train/component.py)
    speed.start_step(step, logging_step); micro_batches = speed.read_batch(loader); ...; speed.end_step()
    record.update(speed.interval(tokens))       # on a logging step: tokens/s, MFU, data wait, host syncs
    speed.check(step, record)                   # the watchdog (once, after its warm-up)

A host sync (`.item()`, `bool(tensor)`, a device->host copy) makes the CPU wait until the GPU has
finished everything queued, so it cannot queue the next step meanwhile: the GPU idles for the
host's whole per-step overhead. The loop does none outside logging steps; the audit proves it.
On CUDA it uses CUDA's sync debug mode (cheap, and it sees compiled code too). On CPU, where host
and device are one, it counts what would sync on a GPU: `_local_scalar_dense` (what .item(),
bool() and int() dispatch to, from Python or C++) with a TorchDispatchMode, and `.tolist()`,
`.cpu()`, `.numpy()` of floating-point tensors (computed values; the token batches are integer
host tensors by construction) with a TorchFunctionMode. That checks the loop's logic, in eager
mode only.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pretrainer.config.schema import Config, TrainConfig
from pretrainer.core.device import compiles
from pretrainer.core.errors import EXIT_SLOW
from pretrainer.core.hardware import mfu
from pretrainer.train.component import Component, Step, StopRequest, Votes, stopped_with_checkpoint
from pretrainer.train.console import resume_command
from pretrainer.train.events import ThroughputLow

SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class _ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is SCALAR_READ:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    READS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncAudit:
    """Counts host syncs while watching. Off (`enabled` False): every call is free."""

    def __init__(self, device: torch.device, enabled: bool, compiled: bool = False):
        self.device = device
        self.supported = device.type == "cuda" or not compiled  # a dispatch mode and torch.compile do not mix
        self.enabled = enabled and self.supported
        self.count, self._active = 0, None

    @property
    def watching(self) -> bool:
        return self._active is not None

    def watch(self, on: bool) -> None:
        on = on and self.enabled
        if on == (self._active is not None):
            return
        if on:
            if self.device.type == "cuda":
                self._active = warnings.catch_warnings(record=True)
                self._records = self._active.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            else:
                self._active = (_ScalarReads(), _HostReads())
                for mode in self._active:
                    mode.__enter__()
        else:
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                self.count += sum("synchroniz" in str(w.message) for w in self._records)
                self._active.__exit__(None, None, None)
            else:
                for mode in reversed(self._active):
                    self.count += mode.count
                    mode.__exit__(None, None, None)
            self._active = None

    def close(self) -> None:
        self.watch(False)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


class ThroughputWatchdog:
    """The lab rule "if MFU is below 0.30 at hour 1, stop and diagnose", as a check: once
    `train.watchdog_steps` steps have run in this process (compile and warm-up are behind), the
    throughput of the latest logging interval is compared with train.min_mfu / train.min_tokens_per_s.
    Below it: one line of diagnosis, and with train.watchdog_action = "stop" the run stops (every rank
    agrees through the loop's per-step flags: `stop_wanted`) with a checkpoint and exit code 6."""

    def __init__(self, cfg: TrainConfig, first_step: int, say, log):
        self.cfg, self.say, self.log = cfg, say, log
        self.active = bool(cfg.min_mfu or cfg.min_tokens_per_s)
        self.check_from = first_step + cfg.watchdog_steps
        self.done = False
        self.stop_wanted, self.message = 0, ""

    def audits(self, step: int, log_every: int) -> bool:
        """Should the host-sync audit run at this step? In the logging interval before the check."""
        return (
            self.active
            and not self.done
            and self.check_from - log_every < step <= self.check_from + log_every
        )

    def check(self, step: int, throughput: dict, diagnosis: dict) -> None:
        if not self.active or self.done or step < self.check_from:
            return
        self.done = True
        mfu, tokens_per_s = throughput.get("mfu"), throughput["tokens_per_s"]
        low = []
        if self.cfg.min_mfu and mfu is not None and mfu < self.cfg.min_mfu:
            low.append(f"MFU {mfu:.3f} < train.min_mfu {self.cfg.min_mfu:g}")
        if self.cfg.min_mfu and mfu is None:
            self.say(
                "watchdog: train.min_mfu is set but the device's peak is unknown (set budget.peak_tflops); "
                "MFU not checked"
            )
        if self.cfg.min_tokens_per_s and tokens_per_s < self.cfg.min_tokens_per_s:
            low.append(
                f"{tokens_per_s:,.0f} tokens/s < train.min_tokens_per_s {self.cfg.min_tokens_per_s:,.0f}"
            )
        if not low:
            self.say(
                f"watchdog: step {step}: throughput ok ({tokens_per_s:,.0f} tokens/s"
                + (f", MFU {mfu:.3f})" if mfu is not None else ")")
            )
            return
        syncs = diagnosis.get("host_syncs_per_step")
        line = (
            f"watchdog: step {step}: {'; '.join(low)}. compile {'on' if diagnosis['compile'] else 'off'}, "
            f"attention "
            f"{diagnosis['attention']}, data wait {diagnosis['data_wait_fraction']:.1%} of step time, host "
            f"syncs per "
            f"step {'n/a' if syncs is None else f'{syncs:g}'}, activation checkpointing "
            f"{'on' if diagnosis['activation_checkpointing'] else 'off'}"
        )
        self.say(line)
        self.log(
            ThroughputLow(
                {
                    "step": step,
                    "watchdog_slow": 1.0,
                    **throughput,
                    **{
                        f"watchdog/{k}": float(v) for k, v in diagnosis.items() if isinstance(v, (int, float))
                    },
                }
            )
        )
        if self.cfg.watchdog_action == "stop":
            self.stop_wanted, self.message = 1, line


class SpeedMonitor(Component):
    """The loop's speed bookkeeping in one place: tokens/s and MFU per logging interval (not counting
    evaluation and checkpoints: restart() after them), the fraction of it spent reading batches, host
    syncs on the steps between logging steps (always with train.audit_syncs; for the watchdog on CUDA
    only, where counting is cheap), and the throughput watchdog (its vote: "slow")."""

    name = "speed"

    @classmethod
    def build(cls, trainer) -> SpeedMonitor:
        start, env = trainer.start, trainer.env
        speed = cls(
            trainer.cfg,
            trainer.state.tokens,
            start.model_flops_per_token,
            peak_tflops=start.peak_tflops,
            world_size=env.world_size,
            device=env.device,
            first_step=trainer.state.step,
            attention=start.attention,
            say=trainer.say,
            log=trainer.run_log.write,
        )
        speed.resume_command = resume_command(trainer.cfg, env)
        return speed

    def before_step(self, step: Step) -> None:
        self.start_step(step.number, step.logging)

    def vote(self, step: Step, votes: Votes) -> None:
        votes.cast("slow", self.watchdog.stop_wanted)

    def stop_request(self, step: Step, agreed: dict[str, int]) -> StopRequest | None:
        if not agreed["slow"]:
            return None
        said = self.watchdog.message or "watchdog: throughput below the minimum"
        resume = stopped_with_checkpoint(step.number - 1, self.resume_command)
        return StopRequest("throughput_stop", f"{said}: {resume}", EXIT_SLOW)

    def after_step(self, step: Step) -> None:
        self.end_step()  # logging, evaluation and checkpoints after it may sync

    def metrics(self, step: Step) -> dict:
        self.figures = self.interval(step.tokens)
        return self.figures

    def after_log(self, step: Step) -> None:
        if step.record is not None:
            self.check(step.number, self.figures)  # the throughput watchdog, once after its warm-up

    def __init__(
        self,
        cfg: Config,
        tokens: int,
        flops_per_token: float,
        *,
        peak_tflops: float | None,
        world_size: int,
        device: torch.device,
        first_step: int,
        attention: str,
        say,
        log,
    ):
        self.throughput = Throughput(tokens, flops_per_token, peak_tflops, world_size)
        self.watchdog = ThroughputWatchdog(cfg.train, first_step, say, log)
        self.audit_always, self.log_every = cfg.train.audit_syncs, cfg.log.every
        self.device, self.audit_for_watchdog = device, self.watchdog.active and device.type == "cuda"
        compiled = compiles(cfg.train.compile, device)
        self.syncs = HostSyncAudit(device, self.audit_always or self.audit_for_watchdog, compiled)
        self.setup = {
            "compile": compiled,
            "attention": attention,
            "activation_checkpointing": cfg.train.activation_checkpointing,
        }
        self.audited_steps, self.data_wait_s = 0, 0.0

    def start_step(self, step: int, logging_step: bool) -> None:
        audit = self.audit_always or (self.audit_for_watchdog and self.watchdog.audits(step, self.log_every))
        self.syncs.watch(not logging_step and audit)
        self.audited_steps += self.syncs.watching

    def read_batch(self, loader) -> list:
        started = time.perf_counter()
        micro_batches = loader.next_step()
        self.data_wait_s += time.perf_counter() - started
        return micro_batches

    def end_step(self) -> None:
        """Before anything that may sync on purpose (logging, evaluation, checkpoints, a stop)."""
        self.syncs.watch(False)

    def interval(self, tokens: int) -> dict:
        """On a logging step, once the host has waited for the device: the interval's figures."""
        interval_s = self.throughput.interval_s()
        figures = {
            **self.throughput.rate(tokens),
            "data_wait_fraction": self.data_wait_s / max(interval_s, 1e-9),
        }
        if self.audited_steps:
            figures["host_syncs_per_step"] = self.syncs.take() / self.audited_steps
        if self.device.type == "cuda":
            figures["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            # what the caching allocator holds: fragmentation shows as reserved far above allocated
            figures["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.audited_steps, self.data_wait_s = 0, 0.0
        return figures

    def check(self, step: int, figures: dict) -> None:
        self.watchdog.check(step, figures, {**figures, **self.setup})

    def restart(self, tokens: int) -> None:
        """After an evaluation or a checkpoint: the next interval starts now, at `tokens`."""
        self.throughput.restart(tokens)
        self.data_wait_s = 0.0

    def close(self) -> None:
        self.syncs.close()


class Throughput:
    """Tokens per second (and MFU, when the device's peak is known) over the interval since the last
    reading, not counting evaluation and checkpoint time (restart() after them)."""

    def __init__(self, tokens: int, flops_per_token: float, peak_tflops: float | None, world_size: int):
        self.started, self.tokens = time.time(), tokens
        self.flops_per_token, self.peak_tflops, self.world_size = flops_per_token, peak_tflops, world_size

    def restart(self, tokens: int) -> None:
        # the clock and the token count together: the tokens of the steps before an evaluation must not
        # be divided by the time after it (a logged tokens/s 2x the real one)
        self.started, self.tokens = time.time(), tokens

    def interval_s(self) -> float:
        """Seconds since the interval began (read before rate(), which starts the next one)."""
        return time.time() - self.started

    def rate(self, tokens: int) -> dict[str, float]:
        now = time.time()
        tokens_per_s = (tokens - self.tokens) / max(now - self.started, 1e-9)
        self.started, self.tokens = now, tokens
        if not self.peak_tflops:
            return {"tokens_per_s": tokens_per_s}
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_tflops, self.world_size),
        }
