"""In-loop evaluation (eval.tasks_every): a small, fixed subset of eval.tasks and the prompt probes.

    evals = InLoopEvals(cfg.eval, tokenizer, cfg.model.seq_len, batch_tokens, device, amp_dtype)  # tasks read and tokenized once
    record, probes = evals.run(wrapped, model)   # {"suite_score", "acc_norm/TASK", ...}, [{"prompt", "completion"}]

Every rank runs the same items in the same order (under FSDP2 each forward is a collective); rank 0 logs.
"""

from __future__ import annotations

import time

import torch

from pretrainer.config import EvalConfig
from pretrainer.eval.probes import read_probes, run_probes
from pretrainer.eval.task_files import load_tasks
from pretrainer.eval.tasks import (
    continuation_scorer,
    encode_task,
    suite_score,
    task_result,
)


class InLoopEvals:
    def __init__(self, cfg: EvalConfig, tokenizer, seq_len: int, batch_tokens: int, device: torch.device,
                 amp_dtype: torch.dtype | None):
        self.cfg, self.tokenizer, self.seq_len, self.batch_tokens = cfg, tokenizer, seq_len, batch_tokens
        self.device, self.amp_dtype = device, amp_dtype
        self.tasks = load_tasks(cfg.tasks.split(","), cfg.num_fewshot, cfg.tasks_items)  # a bad task fails the launch
        self.encoded = [encode_task(task, tokenizer) for task in self.tasks]
        self.prompts = read_probes(cfg.probes)

    def run(self, model: torch.nn.Module, plain_model: torch.nn.Module) -> tuple[dict, list[dict]]:
        """-> (metrics: the suite score, each task's normalised accuracy, the seconds taken; empty without
        tasks), the probes' completions. `model` scores (DDP/FSDP2-wrapped), `plain_model` generates."""
        started = time.perf_counter()
        record = {}
        if self.tasks:
            scorer = continuation_scorer(model, self.seq_len, self.device, self.amp_dtype, self.batch_tokens)
            results = [task_result(task, scorer(groups)) for task, groups in zip(self.tasks, self.encoded)]
            record = {"suite_score": suite_score(results), **{f"acc_norm/{r['task']}": r["accuracy_norm"] for r in results}}
        probes = run_probes(plain_model, self.tokenizer, self.prompts, self.cfg.probe_tokens, self.device, self.amp_dtype)
        if record:
            record["tasks_eval_s"] = time.perf_counter() - started
        return record, probes
