"""The training loop, top to bottom: set up, then steps of batch -> vote -> forward/backward -> clip ->
spike check -> update -> log -> evaluations and checkpoints.

    cfg = load_config("configs/tiny-cpu.toml", ["--data.dir=data/stdlib-bpe4k"])
    train(cfg)

One optimizer step reads micro_batch x grad_accum sequences of seq_len tokens on each rank, so
tokens_per_step = micro_batch x seq_len x grad_accum x world_size, counted exactly.

The Trainer (train/trainer.py) owns the model, optimizer, data loader and trainer state; every other
concern is a component (train/components.py: checkpoints, spikes, stopping, speed, evaluation,
alerts, console, norms, profiler, ...) that the trainer calls around each step. Before a step trains,
every component votes (stop? drop the batch?) and the ranks agree in one host-side all-reduce: a stop
ends the run there, with a checkpoint when core/end_reasons.py's row for it says so.
"""

from __future__ import annotations

import time

from pretrainer.config.schema import Config
from pretrainer.train.trainer import Trainer


def train(cfg: Config, clock=time.time) -> dict:
    """Train cfg's model on cfg's data in cfg.run.dir, resuming from its newest checkpoint.
    `clock` is the budget guard's (tests pass a fake one). -> the final step, tokens and losses."""
    trainer = Trainer(cfg, clock)  # lock, ranks, signals (a signal from now on stops with a checkpoint)
    try:
        if not trainer.set_up():  # data, resume, model, optimizer, components; step 0's evaluation
            return trainer.result()  # the run is already at its last step
        while trainer.state.step < trainer.end_step:
            step = trainer.begin()  # the components' before_step
            trainer.read(step)  # the batch (a drill may replace it) and the learning rate
            agreed = trainer.vote(step)  # one agreement across ranks; a stop that won ends the run here
            if agreed["drop_batch"]:  # ids outside the vocabulary never reach the embedding
                trainer.drop(step)
                continue
            trainer.forward_backward(step)  # loss, clipped gradients, their norm
            verdict = trainer.spikes.check(step.number, step.loss, step.grad_norm, step.lr)
            if verdict.roll_back_to is not None:  # back to a checkpoint from before the spike
                trainer.roll_back(step, verdict.roll_back_to)
                continue
            step.skip = verdict.skip  # on the device: a flagged update is dropped without a host sync
            trainer.update(step)  # optimizer step, state advanced; the components' after_step
            trainer.log(step)  # logging steps: one record (the host waits for the device here)
            trainer.between_steps(step)  # evaluations, checkpoints
        return trainer.result()
    except BaseException as error:
        trainer.failure = error
        raise
    finally:  # whatever happened: close the components, then say why the run ended in RUN_DIR/exit.json
        trainer.close()
