"""The trainer's evaluations as a component: validation loss and bits per byte every eval.every steps
and at the end, the task subset and the probes every eval.tasks_every steps (eval/inloop.py does the
scoring); step 0's once per run."""

from __future__ import annotations

import math

from pretrainer.core.errors import UserError
from pretrainer.train.component import Component, Step
from pretrainer.train.spikes import NOT_FINITE_FIX


class Evaluation(Component):
    name, state_key = "evaluation", "val_loss"  # state.json: the val loss at the checkpoint's step

    def __init__(self, evals, cfg, trainer):
        self.evals, self.cfg, self.trainer = evals, cfg, trainer

    @classmethod
    def build(cls, trainer) -> Evaluation:
        evals, env, resumed = trainer.start.evals, trainer.env, trainer.start.resume is not None
        run_log = trainer.run_log
        keep_through = trainer.start_step if resumed else -1
        evals.attach(
            trainer.run_dir,
            keep_through,
            is_main=env.is_main,
            write=run_log.write,
            say=trainer.say,
            elapsed=trainer.run_clock.elapsed,
        )
        return cls(evals, trainer.cfg, trainer)

    def at_start(self) -> None:
        """Step 0's: the untrained model's scores, once per run (not on resume)."""
        self._validate(0, 0)
        if self.cfg.eval.tasks_every:
            self.evals.in_context(self.trainer.wrapped, self.trainer.model, 0, 0)

    def between_steps(self, step: Step) -> bool:
        every, tasks_every, last = self.cfg.eval.every, self.cfg.eval.tasks_every, self.cfg.train.max_steps
        worked = False
        if (every and step.number % every == 0) or step.number == last:
            self._validate(step.number, step.tokens)  # every rank, the same batches
            worked = True
        if tasks_every and (step.number % tasks_every == 0 or step.number == last):
            self.evals.in_context(self.trainer.wrapped, self.trainer.model, step.number, step.tokens)
            worked = True
        return worked

    def _validate(self, step: int, tokens: int) -> None:
        """A validation loss that is not finite stops the run as an error, on every rank alike (the loss
        is agreed): the model computes nothing usable, and a checkpoint of it would be kept as good."""
        loss = self.evals.validate(self.trainer.wrapped, step, tokens)
        if not math.isfinite(loss):
            when = (
                "the model's outputs are not finite before any update" if step == 0 else "the model is broken"
            )
            raise UserError(f"step {step}: validation loss {loss}: {when}; {NOT_FINITE_FIX}")

    def state_dict(self) -> float | None:
        return self.evals.val_loss_at(self.trainer.state.step)  # what --checkpoint best ranks by

    def close(self) -> None:
        self.evals.close()
