"""`serve-cost --baseline PATH`: an open-weights model (a local Hugging Face folder the user downloaded,
e.g. GPT-2 124M or SmolLM-135M) measured beside the run's model, on the same device, dtype, batch sizes,
prompt and new-token counts, and price, in the same process: its rows in the same table.

Quality across two tokenizers is compared in bits per byte: each val window of the run's data is decoded
to text and scored by each model through its own tokenizer; each model's first token of the window is
context, the rest is scored, and the bits are divided by the UTF-8 bytes of the scored tokens. Nats per
token and top-1 agreement are per tokenizer, so the baseline has none to compare.

    entry = measure_baseline(Path("models/gpt2"), batches=batches, decode=decode, eot_id=eot_id,
                             device=device, dtype=dtype, speed_settings=speed_settings,
                             usd_per_hour=usd_per_hour)
"""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path

import torch

from pretrainer.analysis.serve_speed import priced, speed_record, sync, timed_rounds
from pretrainer.core.device import tensor_bytes
from pretrainer.core.errors import UserError


def load_baseline(path: Path, device: torch.device, dtype: torch.dtype):
    """-> (the model in eval mode on `device` in `dtype`, its tokenizer), from local files only."""
    import transformers
    from packaging import version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise UserError(
            f"{path}: not a Hugging Face model folder (no config.json); --baseline takes a local folder, "
            f"e.g. one `huggingface-cli download openai-community/gpt2 --local-dir models/gpt2` wrote"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # `dtype` from transformers 4.56 (`torch_dtype` before; deprecated since)
        key = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **{key: dtype})
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: transformers cannot load it ({str(e).splitlines()[0][:200]})") from None
    return model.to(device).eval(), tokenizer


def weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter once (tied ones share storage)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += tensor_bytes(p)
    return total


@torch.inference_mode()
def hf_speed(model, batch: int, *, prompt_tokens: int, new_tokens: int, repeats: int, warmup: int, device):
    """Prefill then greedy decode with the model's own KV cache, timed as measure_speed times ours."""
    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(model.config.vocab_size, (batch, prompt_tokens), generator=generator).to(device)
    # the KV cache's name: `cache` from transformers 5.2x, `past_key_values` before
    accepted = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in accepted else "past_key_values"
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}  # prefill: the last logits only

    def prefill():
        out = model(input_ids=prompt, use_cache=True, **last_only)
        return getattr(out, name), out.logits[:, -1].argmax(dim=-1, keepdim=True)

    def decode_step(state):
        past, next_id = state
        out = model(input_ids=next_id, use_cache=True, **{name: past})
        return getattr(out, name), out.logits[:, -1].argmax(dim=-1, keepdim=True)

    prefill_s, decode_s = timed_rounds(
        prefill, decode_step, new_tokens=new_tokens, warmup=warmup, repeats=repeats, device=device
    )
    return speed_record(
        batch=batch,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        prefill_s=prefill_s,
        decode_s=decode_s,
        kv_bytes=None,
        device=device,
    )


@torch.inference_mode()
def bits_per_byte(model, tokenizer, texts: list[str], device) -> dict:
    """Each text scored by the model through its own tokenizer (its first token is context; windows longer
    than the model's context are cut to it): bits per UTF-8 byte of the scored tokens."""
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", 1024
    )
    nats, scored_bytes, scored_tokens = 0.0, 0, 0
    for text in texts:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"][:limit], encoding["offset_mapping"][:limit]
        if len(ids) < 2:
            continue
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        targets = torch.tensor(ids[1:], device=device)
        nats += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        scored_bytes += len(text[offsets[1][0] : offsets[-1][1]].encode())
        scored_tokens += len(ids) - 1
    if not scored_bytes:
        raise UserError("serve-cost --baseline: the val text gave the baseline nothing to score")
    return {
        "val_bpb": nats / math.log(2) / scored_bytes,
        "val_loss": nats
        / scored_tokens,  # nats per the baseline's own token: not comparable across tokenizers
        "scored_bytes": scored_bytes,
    }


def val_texts(batches, decode, eot_id: int) -> list[str]:
    """The run's val windows as text, cut at each end-of-text (a separator the other tokenizer would spell
    out and pay for; padding after a document is end-of-text too): each piece is scored on its own."""
    texts = []
    for x, y in batches:
        for inputs, targets in zip(x.tolist(), y.tolist()):
            piece: list[int] = []
            for token in inputs + [t for t in targets[-1:] if t >= 0]:
                if token != eot_id:
                    piece.append(token)
                elif piece:
                    texts.append(decode(piece))
                    piece = []
            if piece:
                texts.append(decode(piece))
    return [text for text in texts if text]


def measure_baseline(
    path: Path, *, batches, decode, eot_id: int, device, dtype, speed_settings: dict, usd_per_hour: float
) -> dict:
    """The baseline's entry for serve_cost's table: weights, speed and $ per batch size, bits per byte."""
    entry = {
        "variant": f"baseline: {path.name}",
        "status": "ok",
        "reason": "",
        "dtype": str(dtype).split(".")[-1],
        "format": f"{path} (Hugging Face, not quantised)",
        "baseline_path": str(path),
    }
    started = time.perf_counter()
    model, tokenizer = load_baseline(path, device, dtype)
    sync(device)
    entry["load_s"] = time.perf_counter() - started
    total = weight_bytes(model)
    params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    entry["params"] = params
    entry["weights"] = {
        "total_bytes": total,
        "ratio_to_fp32": total / (4 * params),
        "quantised": {"layers": 0},
        "unquantised": [],
    }
    entry["speed"] = []
    for batch in speed_settings["batch_sizes"]:
        speed = hf_speed(
            model,
            batch,
            prompt_tokens=speed_settings["prompt_tokens"],
            new_tokens=speed_settings["new_tokens"],
            repeats=speed_settings["repeats"],
            warmup=speed_settings["warmup"],
            device=device,
        )
        entry["speed"].append(priced(speed, usd_per_hour))
    entry["quality"] = {
        **bits_per_byte(model, tokenizer, val_texts(batches, decode, eot_id), device),
        "top1_agreement": None,
        "tokenizer": type(tokenizer).__name__,
    }
    del model
    return entry
