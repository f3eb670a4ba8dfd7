"""Validation loss: the mean cross-entropy per token over a fixed set of validation batches.

    evaluate(model, batches, device, amp_dtype, token_bytes)       # in the loop: {"val_loss", "val_bpb"}
    evaluate_target("runs/tiny", ["--eval.batches=50"])        # `pretrainer eval`: a run, a checkpoint or hf:DIR
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrainer.config import Config, ModelConfig, canonical_key, load_config, parse_overrides
from pretrainer.data.loader import open_data_dir, validation_batches
from pretrainer.device import autocast, autocast_dtype, resolve_device
from pretrainer.errors import UserError
from pretrainer.resolve import resolve
from pretrainer.io import atomic_write_json
from pretrainer.runs import OpenRun, WeightLoader, build_model, init_source, open_run, with_overrides
from pretrainer.train.checkpoint import latest_checkpoint


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, amp_dtype: torch.dtype | None,
             token_bytes: torch.Tensor | None = None) -> dict[str, float]:
    """Over a fixed set of batches: {"val_loss": mean loss per token} and, given `token_bytes` (the
    UTF-8 bytes of each token id, Tokenizer.token_byte_lengths), {"val_bpb": bits per byte} = the nats
    of the scored tokens / (ln 2 x their bytes), special tokens (0 bytes) left out of both. Unlike
    the loss, bits per byte compare models with different tokenizers."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    nats, n_bytes = torch.zeros((), dtype=torch.float64, device=device), torch.zeros((), dtype=torch.int64, device=device)
    lengths = token_bytes.to(device) if token_bytes is not None else None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device, amp_dtype):
            losses, loss = model(x, y, per_token=True)
        total_loss += loss.item() * y.numel()
        total_tokens += y.numel()
        if lengths is not None:
            target_bytes = lengths[y]
            nats += (losses.double() * (target_bytes > 0)).sum()
            n_bytes += target_bytes.sum()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a forward without backward
        model.reshard()
    model.train()
    result = {"val_loss": total_loss / total_tokens}
    if lengths is not None:
        result["val_bpb"] = nats.item() / (math.log(2) * max(n_bytes.item(), 1))
    return result


def token_bytes_tensor(tokenizer, vocab_size: int) -> torch.Tensor:
    """Tokenizer.token_byte_lengths padded with 0 to the model's (possibly larger) vocabulary."""
    lengths = tokenizer.token_byte_lengths()
    return torch.tensor(lengths + [0] * (vocab_size - len(lengths)), dtype=torch.int64)


@dataclass
class Weights:
    """What `pretrainer eval` scores: a checkpoint (opened and verified once) or hf:DIR."""
    spec: str  # the checkpoint dir or hf:DIR
    model: ModelConfig  # the weights' shape
    load: WeightLoader
    run: OpenRun | None  # the run, when the weights are a run's checkpoint


def eval_config(target: str | None, overrides: list[str]) -> tuple[Config, Weights]:
    """-> (the config to evaluate with, the weights). `target` is a run dir or checkpoint (its saved
    config: data, seq_len, batch), `hf:DIR`, a TOML config (the old form: init.from or run.dir in
    it), or None (init.from or run.dir from the overrides). The model's shape always comes from the
    weights; overrides may change anything else (data.dir, eval.batches, train.micro_batch, ...)."""
    cfg = None
    if target and target.endswith(".toml"):
        cfg = load_config(target, overrides)
        saved_in_run = Path(target).parent  # RUN/config.toml: that run's newest checkpoint, wherever it is now
        spec = str(saved_in_run) if latest_checkpoint(saved_in_run) else cfg.init.from_ or cfg.run.dir
    else:
        given = load_config(None, overrides, validated=False)
        run_dir_given = any(canonical_key(key) == "run.dir" for key, _ in parse_overrides(overrides))
        spec = target or given.init.from_ or (given.run.dir if run_dir_given else "")
        if not spec:
            raise UserError("eval: say what to evaluate: RUN_DIR_OR_CHECKPOINT or hf:DIR (e.g. pretrainer eval runs/tiny)")
    if spec.startswith("hf:"):
        weights = Weights(spec, *init_source(spec), run=None)
    else:
        run = open_run(spec)
        weights = Weights(str(run.checkpoint), run.cfg.model, run.load_weights, run)
        cfg = cfg or with_overrides(run.cfg, overrides)  # the run's data, seq_len and batch unless overridden
    cfg = cfg or load_config(None, overrides)
    model_overrides = [f"--{key}={value}" for key, value in parse_overrides(overrides) if key.startswith("model.")]
    cfg.model = with_overrides(Config(model=copy.deepcopy(weights.model)), model_overrides).model  # the weights' shape
    return cfg, weights


def evaluate_target(target: str | None, overrides: list[str], out: str | None = None, tasks: list[str] = (),
                    num_fewshot: int = 0) -> dict:
    """`pretrainer eval`: validation loss and bits per byte of a run's newest checkpoint, a checkpoint
    or hf:DIR weights on data.dir's val split (by default the data the run trained on), and the
    in-context `tasks` (task files, eval/tasks.py); written to RUN_DIR/eval-STEP.json for a run's
    checkpoint, or to `out`."""
    cfg, weights = eval_config(target, overrides)
    spec, run = weights.spec, weights.run
    data = open_data_dir(cfg.data.dir)
    device = resolve_device(cfg.train.device)
    amp_dtype = autocast_dtype(cfg.train.dtype, device)
    cfg = resolve(cfg, data=data, source=weights.model, source_where=spec)
    model = build_model(cfg, weights.load, spec).to(device)
    batches = validation_batches(data.tokens("val"), cfg.model.seq_len, cfg.train.micro_batch, cfg.eval.batches)
    scores = evaluate(model, batches, device, amp_dtype, token_bytes_tensor(data.tokenizer, cfg.model.vocab_size))
    tokens = sum(y.numel() for _, y in batches)
    result = {"weights": spec, "step": run.step if run else None, "data_dir": str(data.path), "tokenizer": data.tokenizer.name,
              **scores, "tokens": tokens}
    print(f"{spec}: val loss {scores['val_loss']:.4f} nats/token, {scores['val_bpb']:.4f} bits/byte over {tokens:,} "
          f"tokens of {data.path}/val.bin")
    if tasks:
        result.update(evaluate_tasks(model, tasks, data.tokenizer, device, amp_dtype, num_fewshot))
    path = Path(out) if out else run.run_dir / f"eval-{run.step:07d}.json" if run else None
    if path is not None:
        atomic_write_json(path, result)
        print(f"wrote {path}")
    return result


def evaluate_tasks(model, task_files: list[str], tokenizer, device: torch.device, amp_dtype: torch.dtype | None,
                   num_fewshot: int) -> dict:
    """Each task file's accuracies, printed as a table; -> {"tasks": [...], "suite_score": ...}."""
    from pretrainer.eval.tasks import continuation_scorer, read_task_file, score_task, suite_score

    scorer = continuation_scorer(model, device, amp_dtype)
    results = [score_task(Path(path).stem, read_task_file(path), scorer, tokenizer, num_fewshot) for path in task_files]
    print(f"{'task':<24} {'items':>6} {'acc':>7} {'acc_norm':>9} {'chance':>7} {'centered':>9}")
    for r in results:
        print(f"{r['task']:<24} {r['items']:>6} {r['accuracy']:>7.3f} {r['accuracy_norm']:>9.3f} {r['chance']:>7.3f} "
              f"{r['centered']:>9.3f}")
    score = suite_score(results)
    print(f"suite score (mean centered accuracy, {num_fewshot}-shot): {score:.4f}")
    return {"tasks": results, "suite_score": score}
