"""Loss spikes: injection drills, online detection on the device, the actions (log, skip,
rollback), and the batch forensics that `pretrainer postmortem` reads. The training loop talks to
one object, `SpikeGuard`, and asks it three questions per step:

    micro_batches, lr = guard.adjust_batch(step, cursor, micro_batches, lr) # drills, post-rollback LR
    flag = guard.out_of_vocab(micro_batches)      # ids outside the vocab? agreed across ranks, then
    guard.reject(step, cursor)                    # on every rank when any rank saw one
    verdict = guard.check(step, loss, grad_norm, lr)                          # skip? roll back where?

Injection (`spike.inject_at_step = N`, for `spike.inject_batches` optimizer steps):
  rare  replace the batches with sequences drawn from the rarest 1% of the training vocabulary
        (by unigram count, cached in the user's cache dir), weighted towards the rarest, which
        the model predicts worst: a high cross-entropy, large gradients on rarely-updated embeddings
  lr    multiply the learning rate by `spike.lr_factor`
  data  feed garbage: a constant-token batch (`spike.data_mode = "constant"`) or token ids past
        the vocabulary (`"out_of_range"`, rejected before they reach the embedding)
The injected batches are tied to a data position (like real bad data): a rollback that skips the
data window does not meet them again.

Detection: a rolling window of the last `spike.window` loss and grad-norm values (flagged values
left out), inactive until `spike.min_values` are in; a value above mean + `spike.sigmas` x std is a
spike, a non-finite value is one at once. Everything stays on the device: no host sync per step
(except under action=rollback, which must decide before the update: it reads one flag per step).

A persistent change is not a spike: after `spike.max_consecutive` flagged steps in a row (an LR
change, a new data mix, weights an unforeseeable update already damaged), the detector takes the
new level as normal (the window restarts from those recent values, logged as `spike_regime`), and
that step's update is applied. So under `skip` at most max_consecutive - 1 updates in a row are
dropped, and training never freezes. Non-finite values are never accepted.

Actions: `skip` drops the flagged step's own update: right for a bad batch (rare tokens, corrupt
data), whose damage is that update. `rollback` reloads a checkpoint from before the spike's onset:
right for an LR spike, whose damage (the update one step *before* the loss shows it) is already in
the weights. The target is the newest intact checkpoint at least `spike.rollback_margin_steps` + 1
steps before the flagged one, so a checkpoint written right after the damaging update is passed over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from pretrainer.artifacts.checkpoint import checkpoint_step, list_checkpoints, verify_checkpoint
from pretrainer.config.schema import SpikeConfig
from pretrainer.core.errors import UserError
from pretrainer.data.unigram import UnigramStats, training_unigram
from pretrainer.train.component import Component
from pretrainer.train.distributed import DistEnv, broadcast_object
from pretrainer.train.events import InvalidTokens, RolledBack, Spike, SpikeRegime


class SpikeInjector:
    def __init__(self, cfg: SpikeConfig, stats: UnigramStats, vocab_size: int, seq_len: int, seed: int):
        self.cfg, self.stats, self.vocab_size, self.seq_len = cfg, stats, vocab_size, seq_len
        self.generator = torch.Generator().manual_seed(seed + 7919)
        self.start_cursor: int | None = None  # the data position the bad window starts at
        weights = 1.0 / stats.counts[stats.rare_ids].astype(np.float64)  # rarer tokens more often
        self.rare_ids = torch.from_numpy(stats.rare_ids)
        self.rare_weights = torch.from_numpy(weights / weights.sum())

    def active(self, step: int, cursor: int, sequences_per_step: int) -> bool:
        """Is the step about to run (1-based `step`, reading from data position `cursor`) injected?"""
        if not self.cfg.inject_at_step:
            return False
        if self.start_cursor is None:
            if step != self.cfg.inject_at_step:
                return False
            self.start_cursor = cursor
        return self.start_cursor <= cursor < self.start_cursor + self.cfg.inject_batches * sequences_per_step

    def lr_factor(self) -> float:
        return self.cfg.lr_factor if self.cfg.inject_kind == "lr" else 1.0

    def replace(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.cfg.inject_kind == "lr":
            return micro_batches
        out = []
        for x, _ in micro_batches:
            shape = (x.size(0), self.seq_len + 1)
            if self.cfg.inject_kind == "rare":
                picks = torch.multinomial(
                    self.rare_weights, shape[0] * shape[1], replacement=True, generator=self.generator
                )
                windows = self.rare_ids[picks].view(shape)
            elif self.cfg.data_mode == "constant":
                token = int(torch.randint(0, self.vocab_size, (1,), generator=self.generator))
                windows = torch.full(shape, token, dtype=torch.long)
            else:  # out_of_range: ids the embedding does not have
                windows = torch.randint(
                    self.vocab_size, self.vocab_size + 1000, shape, generator=self.generator
                )
            out.append((windows[:, :-1], windows[:, 1:]))
        return out


@dataclass
class Flags:
    spike: torch.Tensor  # bool, on the device
    nonfinite: torch.Tensor
    regime: torch.Tensor  # this step ended a run of max_consecutive flags: the new level is normal now


class SpikeMonitor:
    """Rolling mean + k sigma over loss and grad norm, all on the device (no host sync)."""

    def __init__(
        self, window: int, min_values: int, sigmas: float, device: torch.device, max_consecutive: int = 0
    ):
        self.window, self.min_values, self.sigmas = window, min_values, sigmas
        self.max_consecutive = min(max_consecutive, window)  # 0: never re-baseline
        self.values = torch.zeros(2, window, device=device)  # row 0 loss, row 1 grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)
        # values before detection is on
        self.required = torch.full((), min_values, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.recent = torch.zeros(2, window, device=device)  # the current run of flagged (finite) values
        self.consecutive = torch.zeros((), dtype=torch.long, device=device)

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Flags:
        current = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        nonfinite = ~torch.isfinite(current).all()
        valid = (torch.arange(self.window, device=current.device) < self.count).float()
        n = valid.sum().clamp(min=1)
        mean = (self.values * valid).sum(dim=1) / n
        std = (((self.values - mean[:, None]) * valid) ** 2).sum(dim=1).div((n - 1).clamp(min=1)).sqrt()
        threshold = mean + self.sigmas * torch.maximum(std, 1e-3 * mean.abs())
        spike = ((current > threshold).any() & (self.count >= self.required)) | nonfinite
        # a run of finite flags: remember its values; at max_consecutive they become the new window
        finite_spike = spike & ~nonfinite
        slot = (self.consecutive % self.window).view(1, 1).expand(2, 1)
        self.recent.scatter_(
            1, slot, torch.where(finite_spike, current, self.recent.gather(1, slot).squeeze(1)).view(2, 1)
        )
        self.consecutive.copy_(
            torch.where(finite_spike, self.consecutive + 1, torch.where(nonfinite, self.consecutive, 0))
        )
        regime = (self.consecutive >= self.max_consecutive) & (self.max_consecutive > 0)
        spike = spike & ~regime
        keep = ~spike  # flagged values stay out of the window, so a burst cannot hide itself
        slot = self.position.view(1, 1).expand(2, 1)
        self.values.scatter_(
            1, slot, torch.where(keep, current, self.values.gather(1, slot).squeeze(1)).view(2, 1)
        )
        self.position.copy_((self.position + keep.long()) % self.window)
        self.count.copy_(torch.clamp(self.count + keep.long(), max=self.window))
        # new regime: the window restarts from the run's values (this step's last)
        self.values.copy_(torch.where(regime, self.recent, self.values))
        self.count.copy_(torch.where(regime, torch.clamp(self.consecutive, max=self.window), self.count))
        self.position.copy_(torch.where(regime, self.count % self.window, self.position))
        # detection stays on in the new regime
        self.required.copy_(torch.where(regime, self.count, self.required))
        self.consecutive.copy_(torch.where(regime, 0, self.consecutive))
        return Flags(spike=spike, nonfinite=nonfinite, regime=regime)

    def state_dict(self) -> dict:
        return {
            "values": self.values.tolist(),
            "count": int(self.count),
            "position": int(self.position),
            "recent": self.recent.tolist(),
            "consecutive": int(self.consecutive),
            "required": int(self.required),
        }

    def load_state_dict(self, state: dict) -> None:
        self.values.copy_(torch.tensor(state["values"], device=self.values.device))
        self.count.fill_(state["count"])
        self.position.fill_(state["position"])
        if "recent" in state:  # absent in checkpoints written before regime changes existed
            self.recent.copy_(torch.tensor(state["recent"], device=self.recent.device))
            self.consecutive.fill_(state["consecutive"])
            self.required.fill_(state["required"])


def utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


@dataclass
class Flagged:
    """A flagged step whose values stay on the device until the next logging step reads them."""

    step: int
    lr: float
    elapsed_s: float
    wall_time: float
    batch: np.ndarray | None  # the step's token ids (rank 0): forensics only if it was flagged
    values: torch.Tensor  # [loss, grad norm, flagged (and not yet logged), update skipped]


@dataclass
class Verdict:
    skip: torch.Tensor | None = None  # 1.0 on the device: drop this update (fused AdamW's found_inf)
    roll_back_to: Path | None = None  # reload this checkpoint instead of stepping


@dataclass
class SpikeGuard(Component):
    """Detection, drills and actions for one run; its state_dict is part of the trainer state.

    log(record) writes to the run's metrics, say(text) to the console; elapsed() is the run's clock.
    As a trainer component: its vote "drop_batch" (ids outside the vocabulary on any rank), the
    flagged steps and the batch's statistics on logging steps, its state under "spike".
    """

    name, state_key = "spikes", "spike"

    cfg: SpikeConfig
    unigram: UnigramStats
    vocab_size: int
    seq_len: int
    seed: int
    run_dir: Path
    env: DistEnv
    log: Callable[[dict], None]
    say: Callable[[str], None]
    elapsed: Callable[[], float]
    rollbacks: int = 0
    rollback_lr_until: int = -1  # steps <= this run at rollback_lr_factor x the LR (after a rollback)
    batch: np.ndarray | None = None  # the current step's token ids, rank 0 only
    batch_ids: np.ndarray | None = None  # the same on every rank (for reject)
    pending: list[Flagged] = field(default_factory=list)
    # a collective every rank runs before rank 0 picks a rollback's checkpoint (the loop: settle the writer)
    before_rollback: Callable[[], None] = lambda: None

    @classmethod
    def build(cls, trainer) -> SpikeGuard:
        cfg, model_cfg = trainer.cfg, trainer.cfg.model
        guard = cls(
            cfg.spike,
            training_unigram(trainer.start.data, model_cfg.vocab_size),
            model_cfg.vocab_size,
            model_cfg.seq_len,
            cfg.train.seed,
            trainer.run_dir,
            trainer.env,
            trainer.run_log.write,
            trainer.say,
            trainer.run_clock.elapsed,
        )
        # rank 0 picks a rollback's checkpoint once the write in flight has landed
        guard.before_rollback = lambda: trainer.checkpointing.settle()
        return guard

    def vote(self, step, votes) -> None:
        votes.cast("drop_batch", self.out_of_vocab(step.micro_batches))

    def metrics(self, step) -> dict:
        self.flush()  # the flagged steps since the last log
        return self.batch_forensics(self.batch, histogram=False)

    def __post_init__(self):
        self.monitor = SpikeMonitor(
            self.cfg.window, self.cfg.min_values, self.cfg.sigmas, self.env.device, self.cfg.max_consecutive
        )
        self.injector = (
            SpikeInjector(self.cfg, self.unigram, self.vocab_size, self.seq_len, self.seed)
            if self.cfg.inject_at_step
            else None
        )

    def adjust_batch(self, step: int, cursor: int, micro_batches: list, lr: float, sequences_per_step: int):
        """Drills replace the batch (or scale the LR); after a rollback the LR is reduced for a while.
        `step` is the 1-based step about to run, reading from data position `cursor`."""
        if self.injector is not None and self.injector.active(step, cursor, sequences_per_step):
            micro_batches = self.injector.replace(micro_batches)
            lr *= self.injector.lr_factor()
            self.log(
                {
                    "step": step,
                    "spike_injected": 1.0,
                    "inject_kind": self.cfg.inject_kind,
                    "data_cursor": cursor,
                    "lr": lr,
                    "elapsed_s": self.elapsed(),
                }
            )
        if step <= self.rollback_lr_until:
            lr *= self.cfg.rollback_lr_factor
        return micro_batches, lr

    def out_of_vocab(self, micro_batches: list) -> int:
        """1 if this rank's batch holds token ids outside the vocabulary (checked on the host copy: no
        device sync). The loop agrees on it across ranks, then calls `reject` when any rank saw one.
        Keeps the batch's ids (rank 0: for the statistics of a flagged or logged step)."""
        # (a target outside the loss mask is IGNORE_INDEX, -1: its id is in the inputs or another window)
        self.batch_ids = torch.cat(
            [t.reshape(-1) for x, y in micro_batches for t in (x, y[:, -1:].clamp(min=0))]
        ).numpy()
        self.batch = self.batch_ids if self.env.is_main else None
        return int(int(self.batch_ids.max()) >= self.vocab_size or int(self.batch_ids.min()) < 0)

    def reject(self, step: int, cursor: int) -> None:
        """The batch just checked by out_of_vocab had ids outside the vocabulary on some rank: it never
        reaches the embedding. Under action=log the run stops with an error, otherwise every rank drops it."""
        max_id = int(self.batch_ids.max())
        self.log(
            InvalidTokens(
                {
                    "step": step,
                    "invalid_tokens": 1.0,
                    "max_token_id": max_id,
                    "data_cursor": cursor,
                    "elapsed_s": self.elapsed(),
                }
            )
        )
        if self.cfg.action == "log":
            ids = f"token ids up to {max_id}" if max_id >= self.vocab_size else "token ids (on another rank)"
            raise UserError(
                f"step {step}: {ids} >= model.vocab_size {self.vocab_size} in the batch at data position "
                f"{cursor}: "
                f"corrupted data, rejected before the embedding (spike.action = skip or rollback drops such "
                f"batches)"
            )
        self.say(f"step {step}: batch with token ids outside the vocabulary dropped")

    def batch_forensics(self, batch_ids: np.ndarray | None, histogram: bool = True) -> dict:
        """The statistics of a batch's ids against the training distribution (rank 0; computed only for
        the steps that are logged or flagged, so ranks do not drift apart doing host work every step)."""
        if batch_ids is None:
            return {}
        valid = batch_ids[(batch_ids >= 0) & (batch_ids < self.vocab_size)]
        stats = self.unigram.batch_stats(batch_ids)
        return {**stats, "rank_histogram": self.unigram.rank_histogram(valid)} if histogram else stats

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> Verdict:
        """Flag the step on the device (no sync), and say what to do with its update. `loss` must be the
        same on every rank, so every rank takes the same decision."""
        flags = self.monitor.update(loss, grad_norm)
        logged = False
        # rollback decides at once: a host sync per step
        if self.cfg.action == "rollback" and bool(flags.spike):
            self.log(
                Spike(
                    {
                        "step": step,
                        "spike": 1.0,
                        "spike_loss": loss.item(),
                        "spike_grad_norm": grad_norm.item(),
                        "skipped": 1.0,
                        "lr": lr,
                        "elapsed_s": self.elapsed(),
                        "time_utc": utc(time.time()),
                        **self.batch_forensics(self.batch),
                    }
                )
            )
            # rank 0 decides, once a checkpoint write in flight has landed (it is a candidate, or retired)
            self.before_rollback()
            target = broadcast_object(self.rollback_target(step) if self.env.is_main else None, self.env)
            if target is not None:
                return Verdict(roll_back_to=target)
            logged = True  # no checkpoint to go back to: the update is skipped instead
        skip = (flags.nonfinite | flags.spike if self.cfg.action != "log" else flags.nonfinite).float()
        values = torch.stack(
            [loss.float(), grad_norm.float(), flags.spike.float() * (not logged), skip, flags.regime.float()]
        )
        self.pending.append(Flagged(step, lr, self.elapsed(), time.time(), self.batch, values))
        return Verdict(skip=skip)

    def rollback_target(self, flagged_step: int) -> Path | None:
        """The newest intact checkpoint from before the spike's onset (at least rollback_margin_steps + 1
        steps before the flagged step), while rollbacks are left."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            return None
        before = [
            c
            for c in list_checkpoints(self.run_dir)
            if checkpoint_step(c) < flagged_step - self.cfg.rollback_margin_steps
        ]
        for checkpoint in reversed(before):
            problem = verify_checkpoint(checkpoint)
            if not problem:
                return checkpoint
            self.say(f"warning: rollback passes over damaged checkpoint {checkpoint}: {problem}")
        return None

    def rolled_back(self, flagged_step: int, checkpoint: Path, to_step: int, loader) -> None:
        """After the weights went back to `to_step`: keep the data going forward, past the bad window,
        and run the next rollback_lr_steps steps at a reduced LR."""
        skipped_from = loader.cursor
        loader.cursor += self.cfg.rollback_skip_steps * loader.sequences_per_step
        self.rollbacks += 1
        self.rollback_lr_until = to_step + self.cfg.rollback_lr_steps
        self.log(
            RolledBack(
                {
                    "step": flagged_step,
                    "rollback": 1.0,
                    "to_step": to_step,
                    "skipped_sequences_from": skipped_from,
                    "skipped_sequences": loader.cursor - skipped_from,
                    "elapsed_s": self.elapsed(),
                }
            )
        )
        self.say(
            f"spike at step {flagged_step}: rolled back to {checkpoint.name}, skipping "
            f"{self.cfg.rollback_skip_steps} batches past the spike"
        )

    def flush(self) -> None:
        """On a logging step: read the flagged steps since the last one (one sync) and log them."""
        for flagged in self.pending:
            loss, grad_norm, spiked, skipped, regime = flagged.values.tolist()
            if regime:
                self.log(
                    SpikeRegime(
                        {
                            "step": flagged.step,
                            "spike_regime": 1.0,
                            "loss_at_regime": loss,
                            "grad_norm_at_regime": grad_norm,
                            "elapsed_s": flagged.elapsed_s,
                        }
                    )
                )
                self.say(
                    f"step {flagged.step}: {self.cfg.max_consecutive} flagged steps in a row; taking the new "
                    f"level "
                    f"(loss {loss:.3f}, grad norm {grad_norm:.3f}) as normal and training on"
                )
            if spiked:
                self.log(
                    Spike(
                        {
                            "step": flagged.step,
                            "spike": 1.0,
                            "spike_loss": loss,
                            "spike_grad_norm": grad_norm,
                            "skipped": skipped,
                            "lr": flagged.lr,
                            "elapsed_s": flagged.elapsed_s,
                            "time_utc": utc(flagged.wall_time),
                            **self.batch_forensics(flagged.batch),
                        }
                    )
                )
                self.say(
                    f"spike at step {flagged.step}: loss {loss:.3f}, grad norm {grad_norm:.3f}"
                    + (" (update skipped)" if skipped else "")
                )
        self.pending.clear()

    def state_dict(self) -> dict:
        return {
            "monitor": self.monitor.state_dict(),
            "rollbacks": self.rollbacks,
            "rollback_lr_until": self.rollback_lr_until,
            "injector_start_cursor": self.injector.start_cursor if self.injector else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.monitor.load_state_dict(state["monitor"])
        self.rollbacks = state["rollbacks"]
        # absent in checkpoints before it was saved
        self.rollback_lr_until = state.get("rollback_lr_until", -1)
        if self.injector is not None:
            self.injector.start_cursor = state["injector_start_cursor"]
