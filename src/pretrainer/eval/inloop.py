"""The training loop's evaluations and where their results go: validation loss and bits per byte
(eval.every), and the task subset and prompt probes (eval.tasks_every).

    evals = LoopEvals(cfg, data, device, amp_dtype)   # at launch: val batches; tasks read and tokenized once
    evals.attach(run_dir, keep_through_step, env.is_main, run_log.write, say, run_clock.elapsed)  # once the
    run dir exists
    val_loss = evals.validate(wrapped, step, tokens)
    evals.in_context(wrapped, model, step, tokens)   # {"suite_score", "acc_norm/TASK"}; probes.jsonl

Every rank runs the same batches, items and prompts in the same order (under FSDP2 each forward is a
collective); rank 0 writes.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pretrainer.artifacts.metrics import MetricsLog
from pretrainer.config.schema import Config
from pretrainer.core.device import uncompiled
from pretrainer.core.errors import UserError
from pretrainer.data.loader import validation_batches
from pretrainer.eval.loss import evaluate, token_bytes_tensor
from pretrainer.eval.probes import format_probes, read_probes, run_probes
from pretrainer.eval.task_files import load_tasks
from pretrainer.eval.tasks import continuation_scorer, encode_task, suite_score, task_result


def data_validation_batches(data, cfg: Config) -> list:
    """eval.batches micro-batches of the val split, packed as in training; a mixture's from each source
    by weight (at least one each), so val_loss is over the same blend the run trains on."""
    sources, weights = data.sources("val", cfg.model.seq_len, cfg.data.packing)
    shares = (
        [max(1, round(cfg.eval.batches * w / sum(weights))) for w in weights]
        if len(sources) > 1
        else [cfg.eval.batches]
    )
    batches = []
    for source, n in zip(sources, shares):
        for inputs, targets in validation_batches(source, cfg.model.seq_len, cfg.train.micro_batch, n):
            largest = max(int(inputs.max()), int(targets.max()))
            if largest >= cfg.model.vocab_size:  # an edited split: one line, not an IndexError mid-run
                raise UserError(
                    f"{source.name}: token id {largest} is outside the model's vocabulary "
                    f"({cfg.model.vocab_size}); the split was changed after `pretrainer prepare` (re-run it)"
                )
            batches.append((inputs, targets))
    return batches


class LoopEvals:
    def __init__(self, cfg: Config, data, device: torch.device, amp_dtype: torch.dtype | None):
        self.cfg, self.tokenizer, self.device, self.amp_dtype = cfg, data.tokenizer, device, amp_dtype
        self.last_val: tuple[int, float] | None = None  # (step, val loss) of the latest validation
        seq_len, micro_batch = cfg.model.seq_len, cfg.train.micro_batch
        self.val_batches = data_validation_batches(data, cfg)
        self.separator = data.eot_id if cfg.data.packing == "document" else None
        self.token_bytes = token_bytes_tensor(data.tokenizer, cfg.model.vocab_size)  # for bits per byte
        self.batch_tokens = micro_batch * seq_len  # what fits a training micro-batch fits a scoring batch
        # a bad task or probes file fails the launch, before the run dir is touched
        on = cfg.eval.tasks_every > 0
        self.tasks = (
            load_tasks(cfg.eval.tasks.split(","), cfg.eval.num_fewshot, cfg.eval.tasks_items) if on else []
        )
        self.encoded = [encode_task(task, data.tokenizer) for task in self.tasks]
        self.prompts = read_probes(cfg.eval.probes) if on else []
        self.write = self.say = self.elapsed = self.probes_log = None

    def attach(self, run_dir: Path, keep_through_step: int, *, is_main: bool, write, say, elapsed) -> None:
        """Where results go: `write` (metrics.jsonl and the trackers), `say`, and RUN_DIR/probes.jsonl on
        rank 0, cut back to the resumed checkpoint's step (also when this launch runs no probes);
        `elapsed()`: the run's clock, read when a record is written."""
        self.write, self.say, self.elapsed = write, say, elapsed
        path = Path(run_dir) / "probes.jsonl"
        if is_main and (self.prompts or path.exists()):
            self.probes_log = MetricsLog(path, keep_through_step)

    def validate(self, model: torch.nn.Module, step: int, tokens: int) -> float:
        scores = evaluate(
            model,
            self.val_batches,
            self.device,
            self.amp_dtype,
            self.token_bytes,
            doc_separator=self.separator,
        )
        self.write({"step": step, **scores, "tokens": tokens, "elapsed_s": self.elapsed()})
        self.say(f"step {step}: val loss {scores['val_loss']:.4f}, {scores['val_bpb']:.4f} bits/byte")
        self.last_val = (step, scores["val_loss"])
        return scores["val_loss"]

    def val_loss_at(self, step: int) -> float | None:
        """The val loss measured at `step` in this process, if the last validation was there."""
        return self.last_val[1] if self.last_val is not None and self.last_val[0] == step else None

    def in_context(
        self, model: torch.nn.Module, plain_model: torch.nn.Module, step: int, tokens: int
    ) -> None:
        """The task subset (`model`: DDP/FSDP2-wrapped, scores) and the probes (`plain_model` generates),
        eagerly: their many shapes compile nothing (core/device.uncompiled)."""
        with uncompiled():
            self._in_context(model, plain_model, step, tokens)

    def _in_context(self, model, plain_model, step: int, tokens: int) -> None:
        started = time.perf_counter()
        if self.tasks:
            scorer = continuation_scorer(
                model, self.cfg.model.seq_len, self.device, self.amp_dtype, self.batch_tokens
            )
            results = [task_result(task, scorer(groups)) for task, groups in zip(self.tasks, self.encoded)]
            self.write(
                {
                    "step": step,
                    "suite_score": suite_score(results),
                    **{f"acc_norm/{r['task']}": r["accuracy_norm"] for r in results},
                    "tasks_eval_s": time.perf_counter() - started,
                    "tokens": tokens,
                    "elapsed_s": self.elapsed(),
                }
            )
            self.say(f"step {step}: suite score {suite_score(results):.4f} over {len(self.tasks)} tasks")
        probes = run_probes(
            plain_model,
            self.tokenizer,
            self.prompts,
            max_new_tokens=self.cfg.eval.probe_tokens,
            device=self.device,
            amp_dtype=self.amp_dtype,
        )
        for row in probes if self.probes_log else ():  # rank 0
            self.probes_log.write({"step": step, "tokens": tokens, **row})
        self.say("\n".join([f"step {step}: probes"] + format_probes(probes)))

    def close(self) -> None:
        if self.probes_log is not None:
            self.probes_log.close()
