"""Loss spikes: injection drills (train/spike_drills.py), online detection on the device
(train/spike_monitor.py), the actions (log, skip, rollback), and the batch forensics that
`pretrainer postmortem` reads. The training loop talks to
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

import math
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
from pretrainer.train.spike_drills import SpikeInjector
from pretrainer.train.spike_monitor import SpikeMonitor

NOT_FINITE_FIX = "check init.from's weights, model.rope_theta, model.init_std, optim.lr and train.precision"


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
    not_finite_in_a_row: int = 0  # steps whose loss or gradient was not finite, up to the last read
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
        """On a logging step: read the flagged steps since the last one (one sync) and log them. Losses
        or gradients not finite for max_consecutive steps in a row (10 if that is 0) stop the run as an
        error: skipping each update cannot help a model that computes nothing finite."""
        for flagged in self.pending:
            loss, grad_norm, spiked, skipped, regime = flagged.values.tolist()
            finite = math.isfinite(loss) and math.isfinite(grad_norm)
            self.not_finite_in_a_row = 0 if finite else self.not_finite_in_a_row + 1
            if self.not_finite_in_a_row >= (self.cfg.max_consecutive or 10):
                self.pending.clear()
                raise UserError(
                    f"step {flagged.step}: loss {loss} and grad norm {grad_norm}: not finite for "
                    f"{self.not_finite_in_a_row} steps in a row, each update skipped; {NOT_FINITE_FIX}"
                )
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
