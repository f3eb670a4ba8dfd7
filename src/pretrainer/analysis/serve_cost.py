"""`pretrainer serve-cost RUN_DIR`: what the trained model costs to serve, in full precision and with
its Linear layers' weights quantised to int8 and int4 (torchao, weight-only), on this machine.

    result = serve_cost(ServeSettings("runs/tiny", variants=["fp32", "int8", "int4"], batch_sizes=[1, 8, 32]))
    # -> RUN_DIR/report/serve_cost.json and serve_cost.md (written atomically), and the same tables printed

Per variant, each loaded afresh from the run's newest intact checkpoint:
  - load: the checkpoint read (from the page cache: one untimed load comes first, so the first
    variant pays no first-read cost), the model built and moved to the device (load_s), then
    quantised (quantize_s);
  - weight memory: the bytes every parameter really holds (a torchao tensor's inner tensors summed:
    int8 values, scales, zero points), for the quantised layers against their fp32 bytes, and for
    the whole model; what stayed unquantised is listed with why (the token embedding and its tied
    output projection, norms, biases, layers whose shape the int4 kernel cannot take);
  - speed, with the KV cache as `pretrainer sample` uses it: a prefill of --prompt-tokens random token
    ids per row (logits of the last position only), then --new-tokens greedy decode steps, at each
    batch size; after --warmup untimed rounds, the median of --repeats timed ones (synchronised on CUDA);
  - cost: $ per million generated tokens = usd_per_hour / 3600 / decode tokens per s x 1e6. Assumed:
    the device is rented whole at that price and kept busy decoding at that batch size (every row
    generating; prefill, idle time and the host's other costs not counted). $ per million prompt
    tokens likewise from the prefill rate;
  - quality: validation loss and bits per byte on the run's own val split (--val-batches batches, as
    `pretrainer eval` scores them), the share of the first val batch's positions whose most likely
    next token is the baseline's, and the in-context tasks of --tasks (off by default); each with
    its delta against the baseline (the first variant that ran), whatever its sign.

Variants: fp32 and bf16 (the weights cast; no quantisation), int8 (torchao Int8WeightOnlyConfig: one
scale per output row) and int4 (groups of --group-size weights per scale and zero point: on CPU
torchao's Int4OpaqueTensor, packed two values a byte for the tinygemm CPU kernel; on CUDA
Int4WeightOnlyConfig, plain packing when its kernels (mslk) are installed, else tinygemm's tile
packing, which pads in_features to a multiple of 1024). What is not quantised, and the activations,
are in bf16 on CUDA; on CPU in fp32 for int8 and in bf16 for int4, the only dtype torchao's CPU int4
kernel is fast on (serving_dtype). In eager mode torchao's int8 weight-only matmul casts the int8
weights to the activations' dtype at every call: it saves memory, not time (measured in eager mode;
torch.compile is not tried). A variant this device cannot run is recorded as skipped with the
reason, not an error.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pretrainer.analysis.report.serve_cost_tables import format_tables
from pretrainer.analysis.serve_speed import priced
from pretrainer.analysis.serve_variants import (
    dtype_name,
    load_variant,
    measure_speed,
    serving_dtype,
    top1_predictions,
)
from pretrainer.core.device import import_torchao
from pretrainer.core.errors import UserError

VARIANTS = ("fp32", "bf16", "int8", "int4")
# when neither --usd-per-hour nor the run's budget.usd_per_gpu_hour says (stated as assumed)
DEFAULT_USD_PER_HOUR = 1.0


@dataclass
class ServeSettings:
    run: str
    variants: list[str] = field(default_factory=list)  # [] = the device's default (default_variants)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_tokens: int = 0  # 0 = seq_len // 2
    new_tokens: int = 0  # 0 = min(64, seq_len - prompt_tokens)
    repeats: int = 3
    warmup: int = 1
    val_batches: int = 8
    group_size: int = 32  # int4: weights per scale and zero point
    usd_per_hour: float | None = None  # None = the run's budget.usd_per_gpu_hour, else DEFAULT_USD_PER_HOUR
    tasks: str = ""  # in-context tasks, as `pretrainer eval --tasks` names them; "" = none
    task_limit: int = 100  # items per task
    device: str = "auto"
    threads: int = 0  # CPU threads for torch; 0 = torch's default
    data_dir: str = ""  # "" = the data the run trained on
    baseline: str = ""  # a local Hugging Face model folder measured beside the run's model ("" = none)
    out: str = ""  # "" = RUN_DIR/report


def default_variants(device: torch.device) -> list[str]:
    """The training precision first (it is the baseline): fp32 on CPU, bf16 on CUDA; then the other
    one (bf16 alone shows what int4's bf16 activations cost on CPU), int8 and int4."""
    return ["bf16", "fp32", "int8", "int4"] if device.type == "cuda" else ["fp32", "bf16", "int8", "int4"]


# --- measuring ---


# --- the verb ---


def serve_cost(settings: ServeSettings) -> dict:
    from pretrainer import __version__
    from pretrainer.artifacts.runs import build_model, open_run, with_overrides
    from pretrainer.config.resolve import resolve
    from pretrainer.core.device import resolve_device
    from pretrainer.core.files import atomic_write_bytes, atomic_write_json
    from pretrainer.core.ownership import mark_output
    from pretrainer.core.streams import progress
    from pretrainer.data.data_dir import open_training_data
    from pretrainer.eval.inloop import data_validation_batches
    from pretrainer.eval.loss import evaluate, token_bytes_tensor
    from pretrainer.model.loss import IGNORE_INDEX

    torchao = import_torchao("serve-cost")

    run = open_run(settings.run)
    device = resolve_device(settings.device)
    if settings.threads < 0:
        raise UserError(f"serve-cost: --threads must be >= 0 (0 = torch's default), got {settings.threads}")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    variants = settings.variants or default_variants(device)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or len(set(variants)) != len(variants):
        raise UserError(
            f"serve-cost: --variants takes distinct names from {', '.join(VARIANTS)}, got "
            f"{','.join(variants)}"
        )
    if not settings.batch_sizes or min(settings.batch_sizes) < 1:
        raise UserError(f"serve-cost: --batch-sizes must be positive, got {settings.batch_sizes}")
    if settings.repeats < 1 or settings.warmup < 0 or settings.val_batches < 1:
        raise UserError("serve-cost: --repeats and --val-batches must be >= 1, --warmup >= 0")
    if settings.group_size not in (32, 64, 128, 256):
        raise UserError(f"serve-cost: --group-size must be 32, 64, 128 or 256, got {settings.group_size}")
    overrides = [f"--eval.batches={settings.val_batches}"] + (
        [f"--data.dir={settings.data_dir}"] if settings.data_dir else []
    )
    if settings.data_dir:
        run.cfg.data.mixture = []  # another data dir replaces the run's mixture
    cfg = with_overrides(run.cfg, overrides)
    seq_len = cfg.model.seq_len
    prompt_tokens = settings.prompt_tokens or seq_len // 2
    new_tokens = settings.new_tokens or min(64, seq_len - prompt_tokens)
    if prompt_tokens < 1 or new_tokens < 1 or prompt_tokens + new_tokens > seq_len:
        raise UserError(
            f"serve-cost: --prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} must fit model.seq_len "
            f"{seq_len} (each at least 1)"
        )
    usd_per_hour, price_source = settings.usd_per_hour, "--usd-per-hour"
    if usd_per_hour is None and run.cfg.budget.usd_per_gpu_hour > 0:
        usd_per_hour, price_source = run.cfg.budget.usd_per_gpu_hour, "the run's budget.usd_per_gpu_hour"
    elif usd_per_hour is None:
        usd_per_hour, price_source = (
            DEFAULT_USD_PER_HOUR,
            "assumed: no --usd-per-hour, no budget.usd_per_gpu_hour in the run",
        )
    if usd_per_hour <= 0:
        raise UserError(f"serve-cost: --usd-per-hour must be > 0, got {usd_per_hour}")

    data = open_training_data(cfg.data.dir, cfg.data.mixture)
    cfg = resolve(cfg, data=data, source=run.cfg.model, source_where=str(run.checkpoint), horizon=False)
    batches = data_validation_batches(data, cfg)
    token_bytes = token_bytes_tensor(data.tokenizer, cfg.model.vocab_size)
    separator = data.eot_id if cfg.data.packing == "document" else None
    tasks, tokenizer = [], data.tokenizer
    if settings.tasks and settings.tasks != "none":
        from pretrainer.eval.task_files import load_tasks

        tasks = load_tasks(
            [s for s in settings.tasks.split(",") if s.strip()], cfg.eval.num_fewshot, settings.task_limit
        )

    print(
        f"serve-cost: {run.checkpoint} (step {run.step}) on {device_name(device)}; variants "
        f"{', '.join(variants)}; "
        f"batch sizes {', '.join(map(str, settings.batch_sizes))}; prompt {prompt_tokens} + {new_tokens} new "
        f"tokens; "
        f"${usd_per_hour:g}/hour ({price_source})",
        flush=True,
    )
    # untimed: every variant's load_s is then a warm-cache load
    build_model(cfg, run.load_weights, str(run.checkpoint))
    results, baseline, baseline_top1 = [], None, None
    bar = progress(len(variants), "serve-cost", "variant")  # minutes of measurement: not in silence
    for index, variant in enumerate(variants):
        bar.n = index
        bar.set_postfix_str(variant)
        entry = {
            "variant": variant,
            "status": "ok",
            "reason": "",
            "dtype": dtype_name(serving_dtype(variant, device)),
        }
        results.append(entry)
        try:
            model = load_variant(
                run, cfg, variant, device=device, group_size=settings.group_size, entry=entry
            )
        # torchao raises what its kernels raise: a variant this device cannot run
        except Exception as e:
            message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            entry.update(status="skipped", reason=f"{type(e).__name__}: {message}")
            bar.write(f"  {variant}: skipped ({entry['reason']})")  # above the bar, never into it
            continue
        entry["speed"] = []
        for batch in settings.batch_sizes:
            speed = measure_speed(
                model,
                batch,
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                repeats=settings.repeats,
                warmup=settings.warmup,
                device=device,
            )
            entry["speed"].append(priced(speed, usd_per_hour))
        quality = evaluate(model, batches, device, None, token_bytes, doc_separator=separator)
        model.eval()
        top1 = top1_predictions(model, batches[0][0], device)
        if baseline is None:
            baseline, baseline_top1 = entry, top1
        quality["top1_agreement"] = float((top1 == baseline_top1).float().mean())
        if tasks:
            from pretrainer.eval.tasks import continuation_scorer, score_task, suite_score

            scorer = continuation_scorer(model, seq_len, device, None, cfg.train.micro_batch * seq_len)
            quality["tasks"] = [score_task(task, scorer, tokenizer) for task in tasks]
            quality["suite_score"] = suite_score(quality["tasks"])
        base_quality = baseline["quality"] if baseline is not entry else quality
        for key in ("val_loss", "val_bpb", "suite_score"):
            if key in quality:
                quality[f"delta_{key}"] = quality[key] - base_quality[key]
        entry["quality"] = quality
        bar.write(
            f"  {variant}: {entry['weights']['total_bytes'] / 2**20:.2f} MiB of weights, decode "
            f"{entry['speed'][-1]['decode_tokens_per_s']:,.0f} tokens/s at batch {settings.batch_sizes[-1]}, "
            f"val loss {quality['val_loss']:.4f}"
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.n = len(variants)
    bar.close()

    if settings.baseline:  # an open-weights model of the user's, measured the same way in this process
        from pretrainer.analysis.serve_baseline import measure_baseline

        speed_settings = {
            "batch_sizes": settings.batch_sizes,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "repeats": settings.repeats,
            "warmup": settings.warmup,
        }
        entry = measure_baseline(
            Path(settings.baseline),
            batches=batches,
            decode=data.tokenizer.decode,
            eot_id=data.eot_id,
            device=device,
            dtype=serving_dtype(variants[0], device),
            speed_settings=speed_settings,
            usd_per_hour=usd_per_hour,
        )
        quality = entry["quality"]
        quality["delta_val_loss"] = None  # nats per token of another tokenizer
        quality["delta_val_bpb"] = quality["val_bpb"] - baseline["quality"]["val_bpb"] if baseline else None
        results.append(entry)
        print(
            f"  {entry['variant']}: {entry['weights']['total_bytes'] / 2**20:.2f} MiB of weights, decode "
            f"{entry['speed'][-1]['decode_tokens_per_s']:,.0f} tokens/s at batch {settings.batch_sizes[-1]}, "
            f"{quality['val_bpb']:.4f} bits/byte",
            flush=True,
        )

    result = {
        "run": str(run.run_dir),
        "checkpoint": str(run.checkpoint),
        "step": run.step,
        "device": {
            "type": device.type,
            "name": device_name(device),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchao": torchao.__version__,
            "pretrainer": __version__,
        },
        "settings": {
            **asdict(settings),
            "variants": variants,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "val_tokens": sum(int((y != IGNORE_INDEX).sum()) for _, y in batches),
            "top1_positions": batches[0][0].numel(),
            "data_dir": str(data.path),
        },
        "usd_per_hour": usd_per_hour,
        "usd_per_hour_source": price_source,
        "cost_assumption": (
            "$ per million generated tokens = usd_per_hour / 3600 / decode tokens per s x 1e6: the device "
            "rented whole and kept busy decoding at that batch size; prefill and idle time not counted. "
            "Decoded by eager PyTorch with a KV cache (no torch.compile, no CUDA graphs, no continuous "
            "batching): an upper bound on what a serving engine (vLLM, llama.cpp) would cost"
        ),
        "baseline": baseline["variant"] if baseline else None,
        "variants": results,
    }
    out = Path(settings.out) if settings.out else run.run_dir / "report"
    if not out.exists():  # the run's report dir, made here first: `export` fills it, keeping these files
        out.mkdir(parents=True)
        mark_output(out, "report")
    text = format_tables(result)
    atomic_write_json(out / "serve_cost.json", result)
    atomic_write_bytes(out / "serve_cost.md", text.encode())
    result["written"] = [str(out / "serve_cost.json"), str(out / "serve_cost.md")]
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
