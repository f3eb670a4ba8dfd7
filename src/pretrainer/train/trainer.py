"""The trainer: the model, its optimizer, the data loader and the trainer state, and the ordered list of
components (train/components.py) whose hooks it calls around each step. train/loop.py drives it.

    trainer = Trainer(cfg, clock)      # lock, ranks, signals, console
    trainer.set_up()                   # data, resume, model, optimizer, components; the run dir
    step = trainer.begin(); trainer.read(step); agreed = trainer.vote(step) ...

What it does itself is what every run does: read the batch, forward/backward, clip, step, advance
the state, log the step's record, and act on the step's one agreement across ranks (stop, with a
checkpoint when the reason's row says so; drop a batch). Everything else is a component's.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pretrainer.artifacts.run_lock import RunDirLock
from pretrainer.config.schema import Config, RunConfig
from pretrainer.core.device import use_deterministic_kernels
from pretrainer.core.end_reasons import BY_NAME, exit_status, first_stop
from pretrainer.core.errors import EXIT_FILE_ENV, NotThisRun, RunStopped
from pretrainer.core.secrets import lost_secret, redact, reveal
from pretrainer.optim.schedule import lr_at, set_lr
from pretrainer.optim.sizes import optimizer_state_bytes
from pretrainer.train.budget import launch_cost_check, resumed_step_s
from pretrainer.train.checkpoint import restore_checkpoint
from pretrainer.train.component import Step, Votes
from pretrainer.train.components import REGISTRY, build_components
from pretrainer.train.console import Console, closing_lines
from pretrainer.train.distributed import (
    DistEnv,
    agree_max,
    full_tensor,
    init_distributed,
    keep_grads,
    on_rank0,
    shutdown,
)
from pretrainer.train.norms import layer_group_grad_norms
from pretrainer.train.run_end import after_the_run
from pretrainer.train.setup import run_record, set_up, write_run_dir
from pretrainer.train.state import RunClock, TrainerState
from pretrainer.train.step import forward_backward
from pretrainer.train.stopping import StopSignal, write_exit_record
from pretrainer.train.tracking import RunLog

# tqdm's default write lock includes a multiprocessing semaphore that forked processes share: one killed
# while printing (kill -9, the OOM killer) would leave it taken for good, and every later line would
# hang. A thread lock, and a fresh one in each forked child (a thread may hold it at the fork).
tqdm.set_lock(threading.RLock())
os.register_at_fork(after_in_child=lambda: tqdm.set_lock(threading.RLock()))


class Trainer:
    def __init__(self, cfg: Config, clock=time.time):
        """`clock`: the budget guard's (tests pass a fake one)."""
        self.cfg, self.budget_clock, self.run_dir = cfg, clock, Path(cfg.run.dir)
        self.run_clock = RunClock()  # from entry: start-up (data, load, init, compile) is billed time too
        use_deterministic_kernels(cfg.train.deterministic)  # before the first cuBLAS call
        self.env = init_distributed(cfg.train.device, cfg.parallel.timeout_s, cfg.ckpt.write_timeout_s)
        # only rank 0 talks and writes
        self.say = tqdm.write if self.env.is_main else (lambda *args, **kwargs: None)
        self.console = Console()  # a console that goes away is switched off; rank 0 copies it to train.log
        self.signals = StopSignal()
        self.signals.install()  # from now on SIGTERM/SIGINT ask for a checkpoint and a clean exit
        self.lock = RunDirLock(self.run_dir)  # rank 0 holds it for the job: one trainer per run dir
        self.run_log = self.state = self.loader = self.failure = None
        self.components, self.start_step, self.last_loss = [], None, None

    # --- before the first step ---

    def set_up(self) -> bool:
        """Lock the run dir, set the run up, build the components, restore the state on resume.
        -> False when there is nothing to do (the run is already at its last step)."""
        env = self.env
        on_rank0(self.lock.acquire, env, f"{self.run_dir}: cannot lock it")  # before anything reads the run
        start = self.start = set_up(self.cfg, self.run_dir, env, self.say)  # said as it goes
        self.cfg, resume, self.loader = start.cfg, start.resume, start.loader
        self.model, self.wrapped, self.optimizer = start.model, start.wrapped, start.optimizer
        self.start_step, self.end_step, self.max_steps = (
            start.start_step,
            start.end_step,
            self.cfg.train.max_steps,
        )
        if self.start_step >= self.end_step:
            self.say(f"nothing to do: the run is already at step {self.start_step}")
            self.cfg.run.on_exit = ""  # (resolve's copy) no run ended here: its hook ran when it did
            return False
        launch_cost_check(
            self.cfg.budget,
            start.model_flops_per_token * (self.end_step - self.start_step) * start.step_tokens,
            self.end_step - self.start_step,
            gpus=env.world_size,
            peak_tflops=start.peak_tflops,
            elapsed_before_s=start.elapsed_before,
            say=self.say,
            measured_step_s=resumed_step_s(
                self.cfg.budget, self.run_dir, resume.state if resume else None, env, start.step_tokens
            ),
        )
        # metrics.jsonl and the trackers, cut back to the checkpoint's step
        self.run_log = RunLog(
            self.cfg, self.run_dir, self.start_step if resume else -1, env.is_main, self.say
        )
        if env.is_main:  # the run's first write: train.log gets what was said since the start
            self.console.attach(self.run_dir / "train.log")
        self.state = TrainerState(self.loader, self.run_clock, env)
        if resume is not None:  # step, tokens, data position, RNG, clock
            self.state.load_state_dict(resume.state)
        self.run_info = run_record(
            self.cfg, env, start.data, resume=resume, parent=start.parent, optimizer=self.optimizer
        )
        build_components(self)  # into self.components as each is built: a failure closes those
        for component in self.components:
            if resume is not None and component.state_key in resume.state:
                component.load_state_dict(resume.state[component.state_key])
        self.by_name = {component.name: component for component in self.components}
        self.speed, self.spikes = self.by_name["speed"], self.by_name["spikes"]
        self.checkpointing, self.evaluation = self.by_name["checkpointing"], self.by_name["evaluation"]
        write_run_dir(self.cfg, start.data, self.spikes.unigram, self.run_dir, env)
        if resume is None:  # step 0's evaluations, once per run
            self.evaluation.at_start()
        self.speed.restart(self.state.tokens)  # tokens/s measures training from here
        return True

    def state_json(self) -> dict:
        """state.json: the trainer state, each component's part, and what produced the run."""
        with self.run_clock.frozen():  # elapsed_s and the $ spent by then: one reading
            state = self.state.state_dict()
            parts = {c.state_key: c.state_dict() for c in self.components if c.state_key}
        return {
            **state,
            **parts,
            **self.run_info,
            "optimizer_state_bytes_rank0": optimizer_state_bytes(self.optimizer),
        }

    # --- a step ---

    def begin(self) -> Step:
        number = self.state.step + 1  # the step about to run, 1-based as in every log
        logging = number % self.cfg.log.every == 0 or number == self.end_step
        step = Step(number, logging, last=number == self.end_step)
        for component in self.components:
            component.before_step(step)
        return step

    def read(self, step: Step) -> None:
        """The step's batch (a drill may replace it) and its learning rate."""
        step.cursor = self.loader.cursor
        read = self.speed.read_batch(self.loader)
        lr = lr_at(self.state.step, self.cfg.optim, self.max_steps)
        step.micro_batches, step.lr = self.spikes.adjust_batch(
            step.number, step.cursor, read, lr, self.loader.sequences_per_step
        )
        step.counts = (
            self.loader.last_step_counts
            if step.micro_batches is read
            else (  # a drill's batches: every target counts
                [y.numel() for _, y in step.micro_batches],
                self.loader.sequences_per_step * self.cfg.model.seq_len,
            )
        )
        set_lr(self.optimizer, step.lr)

    def vote(self, step: Step) -> dict[str, int]:
        """The step's one agreement across ranks, on the host (no device sync). A stop that won ends
        the run here: this batch was not trained on (a resume reads it first)."""
        votes = Votes()
        for component in self.components:
            component.vote(step, votes)
        agreed = votes.agree(lambda values: agree_max(values, self.env))
        asked = [r for c in self.components if (r := c.stop_request(step, agreed)) is not None]
        if asked:
            winner = first_stop(request.reason for request in asked)
            self.stop(step, next(request for request in asked if request.reason == winner.name))
        return agreed

    def stop(self, step: Step, request) -> None:
        self.speed.end_step()
        self.loader.cursor = step.cursor
        if BY_NAME[request.reason].checkpoint and self.state.saved_step != self.state.step:
            self.checkpointing.save()
        raise RunStopped(request.message, request.exit_code, request.reason, request.requeue)

    def drop(self, step: Step) -> None:
        """Ids outside the vocabulary on some rank: the batch never reaches the embedding."""
        self.speed.end_step()
        self.spikes.reject(step.number, step.cursor)

    def forward_backward(self, step: Step) -> None:
        start = self.start
        step.loss = forward_backward(
            self.wrapped, step.micro_batches, step.counts, strategy=self.cfg.parallel.strategy, env=self.env,
            amp_dtype=start.amp_dtype, separator=start.separator,
        )  # fmt: skip
        every = self.cfg.spike.layer_norms_every
        if step.logging and every and step.number % every == 0:  # before clipping changes them
            step.group_norms = layer_group_grad_norms(self.model)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        step.grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))

    def roll_back(self, step: Step, checkpoint: Path) -> None:
        """To a checkpoint from before a spike: the weights, step, tokens and RNG go back, the data on."""
        self.checkpointing.settle()  # a write in flight lands before newer checkpoints are retired
        self.state.rewind(restore_checkpoint(checkpoint, self.wrapped, self.model, self.optimizer, self.env))
        self.spikes.rolled_back(step.number, checkpoint, self.state.step, self.loader)
        self.speed.restart(self.state.tokens)  # tokens went back: the next interval starts here
        self.zero_grad()

    def update(self, step: Step) -> None:
        self.optimizer.found_inf = step.skip  # the optimizer drops the whole update when this is 1
        self.optimizer.step()
        self.zero_grad()
        self.state.advance(self.start.step_tokens, step.counts[1])  # tokens; targets trained on
        step.tokens = self.state.tokens
        for component in self.components:
            component.after_step(step)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=not keep_grads(self.cfg.parallel.strategy, self.env))

    def log(self, step: Step) -> None:
        """A logging step's record (the host waits for the device here, logging steps only), then
        every component's after_log (on every step)."""
        if step.logging:  # the same steps on every rank: the norms below may be collectives
            self.last_loss, grad_norm = torch.stack([step.loss, step.grad_norm]).tolist()
            record = {
                "step": step.number,
                "loss": self.last_loss,
                "lr": step.lr,
                "grad_norm": grad_norm,
                "tokens": self.state.tokens,
                "elapsed_s": self.run_clock.elapsed(),
                "epoch": self.loader.epoch,
                **(
                    {"trained_tokens": self.state.trained_tokens}
                    if not self.loader.counts_every_target
                    else {}
                ),
                **{f"mix_share/{name}": share for name, share in self.loader.shares().items()},
            }
            step.record = record  # the record so far: a component's metrics may read it
            for component in self.components:
                record.update(component.metrics(step))
            self.run_log.write(record)
        for component in self.components:
            component.after_log(step)

    def between_steps(self, step: Step) -> None:
        """Evaluations and checkpoints; tokens/s then measures training again, not them."""
        worked = [component.between_steps(step) for component in self.components]
        if any(worked):
            self.speed.restart(self.state.tokens)

    # --- the end ---

    def result(self) -> dict:
        if self.state is None:
            resume = self.start.resume
            return {"step": self.start_step, "tokens": resume.state["tokens"] if resume else 0}
        last_val = self.evaluation.evals.last_val
        self.by_name["console"].close()  # the bar's last state, then the closing lines
        self.say(
            closing_lines(
                self.cfg,
                self.env,
                self.state.step,
                self.state.tokens,
                time.time() - self.run_clock.started,
                chat=bool(getattr(self.start.data, "is_chat", False)),
            )
        )
        return {
            "step": self.state.step,
            "tokens": self.state.tokens,
            "loss": self.last_loss,
            "val_loss": last_val[1] if last_val else None,
        }

    def close(self) -> None:
        """However the run ended: close the components, then say why in RUN_DIR/exit.json."""
        if self.run_log is not None and "alerts" not in [c.name for c in self.components]:
            # it failed while the components were being built: its last alert still goes out
            quietly(lambda: self.components.insert(0, REGISTRY["alerts"](self)))
        end_run(
            self.run_dir,
            self.cfg.run,
            self.lock,
            self.env,
            self.failure,
            step=self.state.step if self.state else self.start_step,
            run_log=self.run_log,
            console=self.console,
            closing=[self.signals, *self.components, self.loader],  # the default signal actions first
        )


def end_run(
    run_dir: Path,
    run: RunConfig,
    lock: RunDirLock,
    env: DistEnv,
    failure: BaseException | None,
    *,
    step: int | None,
    run_log: RunLog | None,
    console: Console,
    closing: list = (),
) -> None:
    """Close what the run opened (the last alert first, then the signal handlers: a stuck close is
    not a stop that cannot be stopped), record why it ended (rank 0:
    RUN_DIR/exit.json, when it holds the run dir's lock: never over another trainer's), release the
    lock and leave the process group, even if closing something fails. Then (rank 0, unless the
    `--nproc` launcher does it once every worker is gone) requeue the SLURM job or run run.on_exit."""
    reason, exit_code = exit_status(failure)
    said = str(failure).strip().splitlines() if failure is not None else []  # a bare KeyboardInterrupt: none
    record, owned = None, False
    try:
        for thing in closing:  # the run's last alert, waited for at most a second
            if hasattr(thing, "ended"):
                quietly(lambda: thing.ended(reason, exit_code, step, redact(said[0]) if said else ""))
        for thing in closing:  # each closed whatever the one before did
            if thing is not None:
                quietly(thing.close)
        if run_log is not None:
            quietly(lambda: run_log.close(reason))
    finally:
        try:
            unused = run_log is None  # stopped before the first write: a new run dir goes again
            # only the trainer that owned the run dir: one that found it in use must not run the hook
            owned = lock.held
            hook = reveal(run.on_exit) if owned and not lost_secret(run.on_exit) else ""
            afterwards = {"on_exit": hook, "on_exit_timeout_s": run.on_exit_timeout_s}
            if env.is_main:
                # a launch that was not this run's (NotThisRun) leaves the record of the run's last end
                foreign = isinstance(failure, NotThisRun)
                into_run_dir = lock.held and not (unused and lock.created) and not foreign
                record = write_exit_record(
                    run_dir,
                    reason,
                    exit_code,
                    step,
                    failure,
                    into_run_dir=into_run_dir,
                    launcher_only=afterwards,
                )
            if record is not None:  # train.log's last line: how the run ended (the console's is later)
                console.record(f"exit: {reason} (exit {exit_code}) at step {step}: {record['message']}\n")
        finally:
            try:
                console.close()
            finally:
                lock.close(remove_created=unused)
                shutdown()
    if record is not None and owned and not os.environ.get(EXIT_FILE_ENV):  # else the launcher does it
        after_the_run(record, hook, run.on_exit_timeout_s)


def quietly(close) -> None:
    """close(); a failure to close one thing (a full disk under metrics.jsonl) is one warning line, so
    the others are still closed and the exit record still written."""
    try:
        close()
    except Exception as e:  # noqa: BLE001 (whatever it is, the run's end goes on)
        print(f"warning: while ending the run: {type(e).__name__}: {redact(str(e))[:200]}", file=sys.stderr)
