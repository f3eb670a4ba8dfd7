"""The training loop, top to bottom: config -> model -> data -> guards -> steps -> metrics and checkpoints.

    cfg = load_config("configs/tiny-cpu.toml", ["--data.dir=data/stdlib-bpe4k"])
    train(cfg)

One optimizer step reads micro_batch x grad_accum sequences of seq_len tokens on each rank, so
tokens_per_step = micro_batch x seq_len x grad_accum x world_size, counted exactly.

The main path of a step is batch -> forward/backward -> clip -> step -> log -> eval -> checkpoint.
Everything else is asked of two guards with narrow interfaces: the spike guard (train/spikes.py:
drills, ids outside the vocabulary, skip or roll back) and the stopper (train/stopping.py: budget
and signals, agreed across ranks). What moves as the run trains is one TrainerState (train/state.py),
which is what checkpoints save and what resume and rollback restore.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pretrainer.artifacts.metrics import MetricsLog
from pretrainer.artifacts.run_lock import RunDirLock
from pretrainer.config.schema import Config, RunConfig
from pretrainer.core.device import use_deterministic_kernels
from pretrainer.core.errors import EXIT_FILE_ENV
from pretrainer.core.secrets import redact
from pretrainer.optim.adamw import adamw_update_norm
from pretrainer.optim.schedule import lr_at, set_lr
from pretrainer.optim.sizes import optimizer_state_bytes
from pretrainer.train.alerts import Alerts
from pretrainer.train.budget import launch_cost_check, resumed_step_s
from pretrainer.train.cadence import CheckpointCadence
from pretrainer.train.checkpoint import CheckpointWriter, restore_checkpoint, settle_writes, write_checkpoint
from pretrainer.train.console import Console, closing_lines, resume_command, step_line
from pretrainer.train.distributed import (
    DistEnv,
    agree_max,
    broadcast_object,
    full_tensor,
    init_distributed,
    keep_grads,
    on_rank0,
    shutdown,
)
from pretrainer.train.norms import layer_group_grad_norms, weight_norms
from pretrainer.train.perf import SpeedMonitor
from pretrainer.train.run_end import after_the_run
from pretrainer.train.setup import run_record, set_up, training_unigram, write_run_dir
from pretrainer.train.slurm import SlurmJob, requeue_signal_numbers
from pretrainer.train.spikes import SpikeGuard
from pretrainer.train.state import RunClock, TrainerState
from pretrainer.train.step import forward_backward, stop_run
from pretrainer.train.stopping import Stopper, StopSignal, TimeLimits, exit_status, write_exit_record
from pretrainer.train.tracking import RunLog

# tqdm's default write lock includes a multiprocessing semaphore that forked processes share: one killed
# while printing (kill -9, the OOM killer) would leave it taken for good, and every later line would
# hang. A thread lock, and a fresh one in each forked child (a thread may hold it at the fork).
tqdm.set_lock(threading.RLock())
os.register_at_fork(after_in_child=lambda: tqdm.set_lock(threading.RLock()))


def train(cfg: Config, clock=time.time) -> dict:
    """Train cfg's model on cfg's data in cfg.run.dir, resuming from its newest checkpoint.
    `clock` is the budget guard's (tests pass a fake one). -> the final step, tokens and losses."""
    run_dir = Path(cfg.run.dir)
    run_clock = RunClock()  # from entry: start-up (data, checkpoint load, init, compile) is billed time too
    use_deterministic_kernels(cfg.train.deterministic)  # before the first cuBLAS call
    # rank, world size, device (torchrun or not)
    env = init_distributed(cfg.train.device, cfg.parallel.timeout_s, cfg.ckpt.write_timeout_s)
    device, strategy = env.device, cfg.parallel.strategy
    say = tqdm.write if env.is_main else (lambda *args, **kwargs: None)  # only rank 0 talks and writes
    console = Console()  # a console that goes away is switched off; rank 0 copies it all to train.log
    signals = StopSignal()
    signals.install()  # from now on SIGTERM/SIGINT ask for a checkpoint and a clean exit
    run_log = sequences = evals = progress = state = failure = start_step = speed = alerts = loader = None
    writer = None
    lock = RunDirLock(run_dir)  # rank 0 holds it for the job: one trainer per run dir
    try:
        on_rank0(lock.acquire, env, f"{run_dir}: cannot lock it")  # before anything reads or writes the run
        start = set_up(cfg, run_dir, env, say)  # config, data, resume, model, loader, evals; said
        cfg, resume, model, wrapped, optimizer = (
            start.cfg,
            start.resume,
            start.model,
            start.wrapped,
            start.optimizer,
        )
        data, loader, evals, step_tokens = start.data, start.loader, start.evals, start.step_tokens
        start_step, end_step, max_steps = start.start_step, start.end_step, cfg.train.max_steps
        if start_step >= end_step:
            say(f"nothing to do: the run is already at step {start_step}")
            cfg.run.on_exit = ""  # (resolve's copy) no run ended here: its hook ran when it did
            return {"step": start_step, "tokens": resume.state["tokens"] if resume else 0}
        launch_cost_check(
            cfg.budget,
            start.model_flops_per_token * (end_step - start_step) * step_tokens,
            end_step - start_step,
            env.world_size,
            start.peak_tflops,
            start.elapsed_before,
            say,
            resumed_step_s(cfg.budget, run_dir, resume.state if resume else None, env, step_tokens),
        )

        # --- the run dir, metrics, the guards, and the trainer state (restored on resume) ---
        # cut back to the checkpoint's step
        run_log = RunLog(cfg, run_dir, start_step if resume else -1, env.is_main, say)
        if env.is_main:  # the run's first write: train.log gets what was said since the start
            console.attach(run_dir / "train.log")
        # budget, spikes, throughput, stalls, the run's end: to metrics.jsonl and alerts.webhook_url
        alerts = run_log.alerts = Alerts(cfg.alerts, run_dir, env.is_main, run_log.write, say, max_steps)
        spikes = SpikeGuard(
            cfg.spike,
            training_unigram(data, cfg.model.vocab_size),
            cfg.model.vocab_size,
            cfg.model.seq_len,
            cfg.train.seed,
            run_dir,
            env,
            run_log.write,
            say,
            run_clock.elapsed,
        )
        write_run_dir(cfg, data, spikes.unigram, run_dir, env)
        sequences = (
            MetricsLog(run_dir / f"sequences-rank{env.rank}.jsonl", start_step) if cfg.log.sequences else None
        )
        evals.attach(
            run_dir, start_step if resume else -1, env.is_main, run_log.write, say, run_clock.elapsed
        )
        # None outside SLURM; read on rank 0 (its end time may need squeue) so every rank stops alike
        job = broadcast_object(SlurmJob.from_env() if env.is_main else None, env)
        stopper = Stopper(
            cfg.budget,
            env,
            signals,
            clock,
            run_log.write,
            say,
            resume_command(cfg, env),
            TimeLimits.of(cfg.train.max_hours, cfg.run.stop_margin_s, job),
            requeue_signal_numbers(cfg.run.requeue_signals, job),
        )
        state = TrainerState(loader, spikes, run_clock, stopper.spent_usd, env)
        if resume is not None:  # step, tokens, data position, RNG, clock, spike monitor
            state.load_state_dict(resume.state)
        # state.json: what produced the run
        run_info = run_record(cfg, env, data, resume, start.parent, optimizer)

        writer = CheckpointWriter()  # rank 0's writes, in the background between checkpoints
        spikes.before_rollback = lambda: settle_writes(writer, env)

        def save(wait: bool = True) -> float:  # a collective: every rank gathers, rank 0 writes
            started = run_clock.elapsed()
            write_checkpoint(
                run_dir,
                state.step,
                wrapped,
                model,
                optimizer,
                cfg.ckpt.keep,
                env,
                lambda: {
                    **state.state_dict(),
                    **run_info,
                    "optimizer_state_bytes_rank0": optimizer_state_bytes(optimizer),
                    "val_loss": evals.val_loss_at(state.step),  # what --checkpoint best ranks by
                },
                cfg.ckpt.keep_best,
                writer,
                wait,
            )
            state.saved_step = state.step
            # what the training thread spent on it (plan --from-run counts checkpoints with it)
            took = run_clock.elapsed()
            run_log.write({"step": state.step, "checkpoint_s": took - started, "elapsed_s": took})
            return took - started

        # which steps checkpoint: every ckpt.every, or auto's Young/Daly interval from measured times
        cadence = CheckpointCadence(
            cfg.ckpt.every,
            cfg.ckpt.interruptions_per_hour,
            state.step + 1,
            env,
            run_log.write,
            align=cfg.eval.every if cfg.ckpt.keep_best else 1,  # the best is ranked by a validation there
        )

        # step 0's, once per run
        last_loss, last_val = (None, evals.validate(wrapped, 0, 0) if resume is None else None)
        if cfg.eval.tasks_every and resume is None:
            evals.in_context(wrapped, model, 0, 0)
        progress = tqdm(
            total=max_steps,
            initial=state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            disable=True if not env.is_main else None,
            file=console.terminal,
        )  # None: a bar on a terminal only (its redraws are not train.log's lines)
        # tokens/s, MFU, data wait, host syncs between logging steps; the watchdog (too slow after warm-up:
        # diagnose)
        speed = SpeedMonitor(
            cfg,
            state.tokens,
            start.model_flops_per_token,
            start.peak_tflops,
            env.world_size,
            device,
            state.step,
            start.attention,
            say,
            run_log.write,
        )
        stopper.start(state.step)
        while state.step < end_step:
            step = state.step + 1  # the step about to run, 1-based as in every log
            logging_step = step % cfg.log.every == 0 or step == end_step
            speed.start_step(step, logging_step)
            alerts.step_started(step)  # the stall watchdog times each step (and its drill pauses here)
            cursor = loader.cursor
            read = speed.read_batch(loader)
            micro_batches, lr = spikes.before_step(
                step, cursor, read, lr_at(state.step, cfg.optim, max_steps), loader.sequences_per_step
            )
            counts = (
                loader.last_step_counts
                if micro_batches is read
                else (  # a drill's batches: every target counts
                    [y.numel() for _, y in micro_batches],
                    loader.sequences_per_step * cfg.model.seq_len,
                )
            )
            set_lr(optimizer, lr)

            # the step's one agreement across ranks, on the host (no device sync): stop (signal, budget, too
            # slow), bad token ids
            budget_action, signum, limit, slow, out_of_vocab = agree_max(
                stopper.local_view(state.step, run_clock.elapsed(), max_steps, cfg.parallel.hang_drill_step)
                + [speed.watchdog.stop_wanted, spikes.out_of_vocab(micro_batches)],
                env,
            )
            request = stopper.request(state.step, budget_action, signum, limit, slow, speed.watchdog.message)
            if request is not None:  # this batch was not trained on: a resume reads it first
                stop_run(request, speed, loader, cursor, save if state.saved_step != state.step else None)
            # ids outside the vocabulary never reach the embedding: an error, or the batch is dropped
            if out_of_vocab:
                speed.end_step()
                spikes.reject(step, cursor)
                continue

            step_loss = forward_backward(
                wrapped, micro_batches, counts, strategy, env, start.amp_dtype, start.separator
            )
            group_norms = (
                layer_group_grad_norms(model)
                if logging_step and cfg.spike.layer_norms_every and step % cfg.spike.layer_norms_every == 0
                else {}
            )
            grad_norm = full_tensor(
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
                )
            )

            # spikes: skip the update on the device (non-finite always), or roll back to a checkpoint before
            # the spike
            verdict = spikes.check(step, step_loss, grad_norm, lr)
            if verdict.roll_back_to is not None:
                settle_writes(writer, env)  # a write in flight lands before newer checkpoints are retired
                state.rewind(restore_checkpoint(verdict.roll_back_to, wrapped, model, optimizer, env))
                spikes.rolled_back(step, verdict.roll_back_to, state.step, loader)
                speed.restart(state.tokens)  # tokens went back: the next interval starts here
                progress.n = state.step
                optimizer.zero_grad(set_to_none=not keep_grads(strategy, env))
                continue
            optimizer.found_inf = verdict.skip  # the optimizer drops the whole update when this is 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads(strategy, env))  # DDP: its bucket views stay
            state.advance(step_tokens, counts[1])  # tokens seen; targets trained on (the loss mask's)
            progress.update(1)
            speed.end_step()  # logging, evaluation and checkpoints below may sync
            if sequences:
                sequences.write({"step": step, "ids": [i for micro in loader.last_step_ids for i in micro]})

            if logging_step:  # the same steps on every rank: the norms below may be collectives
                # the host waits for the device: logging steps only
                last_loss, last_grad_norm = torch.stack([step_loss, grad_norm]).tolist()
                # after the wait: the work is done
                elapsed, figures = (run_clock.elapsed(), speed.interval(state.tokens))
                spikes.flush()  # the flagged steps since the last log
                record = {
                    "step": step,
                    "loss": last_loss,
                    "lr": lr,
                    "grad_norm": last_grad_norm,
                    **weight_norms(model, adamw_update_norm(optimizer, verdict.skip)),
                    "tokens": state.tokens,
                    **figures,
                    "elapsed_s": elapsed,
                    "epoch": loader.epoch,
                    **({"trained_tokens": state.trained_tokens} if not loader.counts_every_target else {}),
                    **{f"mix_share/{name}": share for name, share in loader.shares().items()},
                    **spikes.batch_forensics(spikes.batch, histogram=False),
                    **{f"grad_norm/{name}": value.item() for name, value in group_norms.items()},
                }
                if cfg.budget.cap_usd or cfg.budget.usd_per_gpu_hour:
                    record["spent_usd"] = stopper.spent_usd(elapsed)
                run_log.write(record)
                say(step_line(record, end_step, step_tokens))
                cadence.measured_step(
                    step_tokens / figures["tokens_per_s"] if figures["tokens_per_s"] > 0 else 0
                )
                speed.check(step, figures)  # the throughput watchdog, once after its warm-up
            alerts.step_done(step, last_loss if logging_step else None)  # the stall watchdog's heartbeat

            if (cfg.eval.every and step % cfg.eval.every == 0) or step == max_steps:
                last_val = evals.validate(wrapped, step, state.tokens)  # every rank, the same batches
                speed.restart(state.tokens)  # tokens/s measures training, not evaluation

            if cfg.eval.tasks_every and (step % cfg.eval.tasks_every == 0 or step == max_steps):
                evals.in_context(wrapped, model, step, state.tokens)  # the task subset and the probes
                speed.restart(state.tokens)

            if cadence.due(step) or step == end_step:
                cadence.checkpointed(
                    step, save(wait=step == end_step)
                )  # periodic: written as training goes on
                speed.restart(state.tokens)

        progress.close()
        say(closing_lines(cfg, env, state.step, state.tokens, time.time() - run_clock.started))
        return {"step": state.step, "tokens": state.tokens, "loss": last_loss, "val_loss": last_val}
    except BaseException as error:
        failure = error
        raise
    finally:  # whatever happened: close the sinks, then say why the run ended in RUN_DIR/exit.json
        end_run(
            run_dir,
            cfg.run,
            lock,
            env,
            failure,
            state.step if state else start_step,
            run_log,
            console,
            alerts,
            speed,
            signals,
            progress,
            sequences,
            evals,
            loader,
            writer,
        )


def quietly(close) -> None:
    """close(); a failure to close one thing (a full disk under metrics.jsonl) is one warning line, so
    the others are still closed and the exit record still written."""
    try:
        close()
    except Exception as e:  # noqa: BLE001 (whatever it is, the run's end goes on)
        print(f"warning: while ending the run: {type(e).__name__}: {redact(str(e))[:200]}", file=sys.stderr)


def end_run(
    run_dir: Path,
    run: RunConfig,
    lock: RunDirLock,
    env: DistEnv,
    failure: BaseException | None,
    step: int | None,
    run_log: RunLog | None,
    console: Console,
    alerts: Alerts | None,
    *closing,
) -> None:
    """Close what the run opened (the signal handlers first), record why it ended (rank 0:
    RUN_DIR/exit.json, when it holds the run dir's lock: never over another trainer's), release the
    lock and leave the process group, even if closing something fails. Then (rank 0, unless the
    `--nproc` launcher does it once every worker is gone) requeue the SLURM job or run run.on_exit."""
    reason, exit_code = exit_status(failure)
    said = str(failure).strip().splitlines() if failure is not None else []  # a bare KeyboardInterrupt: none
    try:
        if alerts is not None:  # finished, stopped or died: the last alert, waited for at most a second
            quietly(lambda: alerts.ended(reason, exit_code, step, redact(said[0]) if said else ""))
            quietly(alerts.close)
        for thing in closing:  # each closed whatever the one before did: the signal handlers first
            if thing is not None:
                quietly(thing.close)
        if run_log is not None:
            quietly(lambda: run_log.close(reason))
    finally:
        try:
            unused = run_log is None  # stopped before the first write: a new run dir goes again
            # only the trainer that owned the run dir: one that found it in use must not run the hook
            owned = lock.held
            hook = run.on_exit if owned else ""
            record, afterwards = None, {"on_exit": hook, "on_exit_timeout_s": run.on_exit_timeout_s}
            if env.is_main:
                into_run_dir = lock.held and not (unused and lock.created)
                record = write_exit_record(
                    run_dir,
                    reason,
                    exit_code,
                    step,
                    failure,
                    into_run_dir=into_run_dir,
                    launcher_only=afterwards,
                )
            if (
                record is not None
            ):  # train.log's last line: how the run ended (the console's is printed later)
                console.record(f"exit: {reason} (exit {exit_code}) at step {step}: {record['message']}\n")
        finally:
            try:
                console.close()
            finally:
                lock.close(remove_created=unused)
                shutdown()
    if record is not None and owned and not os.environ.get(EXIT_FILE_ENV):  # else the launcher does it
        after_the_run(record, hook, run.on_exit_timeout_s)
