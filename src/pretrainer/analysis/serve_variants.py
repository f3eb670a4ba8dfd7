"""One serving variant of a trained model (fp32, bf16, int8, int4; analysis/serve_cost.py's docstring says
how each is made and measured): its dtype and torchao config, loaded and quantised, what stayed unquantised
and why, the bytes its weights hold, its prefill and decode speed, and its top-1 predictions."""

from __future__ import annotations

import math
import time

import torch

from pretrainer.analysis.serve_speed import speed_record, sync, timed_rounds
from pretrainer.core.device import tensor_bytes


def serving_dtype(variant: str, device: torch.device) -> torch.dtype:
    """The dtype of the weights left unquantised and of the activations: bf16 on CUDA; on CPU fp32,
    except int4, whose CPU kernel (tinygemm's _weight_int4pack_mm_for_cpu) is fast only on bf16
    activations (measured: 8-57x slower than an fp32 matmul on fp32 activations, docs/benchmarks.md)."""
    if variant == "fp32":
        return torch.float32
    if variant == "bf16" or variant == "int4" or device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def quant_config(variant: str, device: torch.device, group_size: int):
    """-> (the torchao config, a name for its weight format)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if variant == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False), "int8 per output row (torchao Int8Tensor)"
    if device.type == "cpu":
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return (
            PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False),
            f"int4, groups of {group_size}, packed for the tinygemm CPU kernel (torchao Int4OpaqueTensor)",
        )
    from torchao.utils import is_mslk_version_at_least

    if is_mslk_version_at_least("1.0.0"):  # the plain format's kernels
        return (
            Int4WeightOnlyConfig(group_size=group_size, set_inductor_config=False),
            f"int4, groups of {group_size}, plain packing (torchao Int4Tensor)",
        )
    return (
        Int4WeightOnlyConfig(
            group_size=group_size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        ),
        f"int4, groups of {group_size}, tinygemm tile packing, in_features padded to 1024 (torchao "
        f"Int4TilePackedTo4dTensor)",
    )


def why_not_quantised(
    name: str, module: torch.nn.Module, *, variant: str, device: torch.device, group_size: int, tied: bool
) -> str:
    """'' when the Linear `module` is quantised in `variant`, else why not."""
    if name == "lm_head":
        return (
            "output projection, tied to the token embedding"
            if tied
            else "output projection (read directly by the fused loss)"
        )
    if variant == "int4":
        if module.in_features % group_size:
            return f"in_features {module.in_features} is not a multiple of --group-size {group_size}"
        if device.type == "cpu" and module.out_features % 16:
            return f"out_features {module.out_features} is not a multiple of 16 (the CPU int4 kernel's tile)"
    return ""


def weight_memory(model: torch.nn.Module, skipped: dict[str, str], quantised: set[str], tied: bool) -> dict:
    """Every parameter (a tied one once) by what happened to it: the quantised layers' weights against
    their fp32 bytes, the rest by kind with why it stayed in the serving precision."""
    groups: dict[str, dict] = {}
    q = {"layers": 0, "params": 0, "bytes": 0, "fp32_bytes": 0, "format": ""}
    total = total_fp32 = 0
    for name, param in model.named_parameters():  # tied weights once
        numel, nbytes = math.prod(param.shape), tensor_bytes(param)
        total, total_fp32 = total + nbytes, total_fp32 + 4 * numel
        module_name, _, leaf = name.rpartition(".")
        if module_name in quantised and leaf == "weight":
            q["layers"] += 1
            q["params"] += numel
            q["bytes"] += nbytes
            q["fp32_bytes"] += 4 * numel
            q["format"] = type(param).__name__
            continue
        if name == "wte.weight":
            kind, why = (
                "token embedding" + (" (= lm_head, tied)" if tied else ""),
                "an embedding lookup, not a matmul",
            )
        elif name == "lm_head.weight":
            kind, why = "lm_head", skipped.get("lm_head", "")
        elif name == "wpe.weight":
            kind, why = "position embedding", "an embedding lookup, not a matmul"
        elif "norm" in module_name.rpartition(".")[2]:
            kind, why = "norms", "elementwise scales"
        elif leaf == "bias":
            kind, why = "biases", "added after the matmul; weight-only quantisation keeps them"
        elif module_name in skipped:
            kind, why = f"{module_name}.weight", skipped[module_name]
        else:
            kind, why = "other", "not a Linear layer's weight"
        group = groups.setdefault(
            kind,
            {
                "what": kind,
                "tensors": 0,
                "params": 0,
                "bytes": 0,
                "dtype": dtype_name(param.dtype),
                "why": why,
            },
        )
        group["tensors"] += 1
        group["params"] += numel
        group["bytes"] += nbytes
    q["ratio_to_fp32"] = q["bytes"] / q["fp32_bytes"] if q["fp32_bytes"] else None
    return {
        "total_bytes": total,
        "total_fp32_bytes": total_fp32,
        "ratio_to_fp32": total / total_fp32,
        "quantised": q,
        "unquantised": list(groups.values()),
    }


@torch.inference_mode()
def measure_speed(
    model: torch.nn.Module,
    batch: int,
    *,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    warmup: int,
    device: torch.device,
) -> dict:
    """Prefill and greedy decode with the KV cache (as model/generate.py runs them), median tokens/s."""
    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(model.cfg.vocab_size, (batch, prompt_tokens), generator=generator).to(device)

    def prefill():  # a fresh cache each round
        cache = model.new_kv_cache(batch)
        logits, _ = model(prompt, kv_cache=cache, last_only=True)
        return cache, logits[:, -1].argmax(dim=-1, keepdim=True)

    def decode_step(state):
        cache, next_id = state
        logits, _ = model(next_id, kv_cache=cache)
        return cache, logits[:, -1].argmax(dim=-1, keepdim=True)

    prefill_s, decode_s = timed_rounds(
        prefill, decode_step, new_tokens=new_tokens, warmup=warmup, repeats=repeats, device=device
    )
    cache = model.new_kv_cache(batch)
    kv_bytes = tensor_bytes(cache.k) + tensor_bytes(cache.v)
    del cache
    return speed_record(
        batch=batch,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        prefill_s=prefill_s,
        decode_s=decode_s,
        kv_bytes=kv_bytes,
        device=device,
    )


@torch.inference_mode()
def top1_predictions(model: torch.nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The most likely next token at every position of one val batch, a row at a time (no batch x
    seq_len x vocab logits at once), on the CPU."""
    return torch.cat([model(row[None].to(device))[0][0].argmax(dim=-1).cpu() for row in batch])


def load_variant(
    run, cfg, variant: str, *, device: torch.device, group_size: int, entry: dict | None = None
) -> torch.nn.Module:
    """The run's checkpoint as `variant` on `device`, in eval mode; `entry` receives load_s, quantize_s,
    format, quantised_layers and weights (weight_memory). Raises what torchao raises when this device
    cannot quantise or run the variant."""
    from torchao.quantization import quantize_

    from pretrainer.artifacts.runs import build_model

    entry = {} if entry is None else entry
    started = time.perf_counter()
    model = (
        build_model(cfg, run.load_weights, str(run.checkpoint))
        .to(device=device, dtype=serving_dtype(variant, device))
        .eval()
    )
    sync(device)
    entry["load_s"] = time.perf_counter() - started
    skipped, quantised = {}, set()
    if variant in ("int8", "int4"):
        config, entry["format"] = quant_config(variant, device, group_size)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                why = why_not_quantised(
                    name,
                    module,
                    variant=variant,
                    device=device,
                    group_size=group_size,
                    tied=cfg.model.tie_embeddings,
                )
                if why:
                    skipped[name] = why
                else:
                    quantised.add(name)
        started = time.perf_counter()
        quantize_(model, config, filter_fn=lambda module, name: name in quantised)
        sync(device)
        entry["quantize_s"] = time.perf_counter() - started
        with torch.inference_mode():  # a kernel this device lacks fails here, not halfway through the timings
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
    else:
        entry["format"] = f"{dtype_name(serving_dtype(variant, device))} (not quantised)"
    entry["quantised_layers"] = sorted(quantised)
    entry["weights"] = weight_memory(model, skipped, quantised, cfg.model.tie_embeddings)
    return model


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
