"""Prompt probes: a few prompts completed greedily, to watch knowledge appear as a run trains.

    prompts = read_probes("")                      # the built-in mix ("text", "code": a built-in set; else a
                                                   # file: one prompt per line)
    rows = run_probes(model, tokenizer, prompts, max_new_tokens=24, device=device, amp_dtype=amp_dtype)
    # rows: [{"prompt", "completion"}, ...]

A probes file has one prompt per line; a literal \\n in a line stands for a newline (code prompts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrainer.core.device import autocast
from pretrainer.core.errors import UserError

# world knowledge and sentence completion (what a small model learns first and last), and code; a
# model trained on code only is asked about code ("code": the quickstart's stdlib corpus)
PROBE_SETS = {
    "text": [
        "The capital of France is",
        "The chemical symbol for gold is",
        "Water freezes at a temperature of",
        "Once upon a time, there was a little",
        "The opposite of hot is",
    ],
    "code": ["import os\\n", "class Error(Exception):\\n", "    def __init__(self", "if __name__ == "],
}
MIXED = PROBE_SETS["text"] + ["def fibonacci(n):\\n", "import numpy as np\\n"]  # "": a corpus of both


def read_probes(path: str) -> list[str]:
    """The prompts in `path` (one per line, \\n for a newline), a built-in set by name ("text", "code";
    a file of that name is ./text), or the built-in mix for ""."""
    if not path or path in PROBE_SETS:
        lines = PROBE_SETS.get(path, MIXED)
    else:
        if not Path(path).is_file():
            raise UserError(
                f'eval.probes: {path}: file not found (one prompt per line; "text" or "code" = a built-in '
                f'set; "" = both)'
            )
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            raise UserError(f"eval.probes: {path}: no prompts")
    return [line.replace("\\n", "\n") for line in lines]


@torch.no_grad()
def run_probes(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> list[dict]:
    """Each prompt's greedy completion (max_new_tokens, cut at end-of-text), with a KV cache. Under
    FSDP2 every rank must call this alike (each forward gathers the weights), so generation never
    stops early on what it produced: every rank runs the same number of forwards."""
    from pretrainer.eval.tasks import evaluation_mode
    from pretrainer.model.generate import generate

    rows = []
    with evaluation_mode(model):
        for prompt in prompts:
            prompt_ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(
                prompt
            )  # as documents start
            ids = torch.tensor([prompt_ids or [tokenizer.eot_id]], dtype=torch.long, device=device)
            with autocast(device, amp_dtype):
                completion = generate(
                    model, ids, max_new_tokens, temperature=0.0, vocab_in_use=tokenizer.vocab_size
                )[0, ids.size(1) :].tolist()
            if tokenizer.eot_id in completion:
                completion = completion[: completion.index(tokenizer.eot_id)]
            rows.append({"prompt": prompt, "completion": tokenizer.decode(completion)})
    return rows


def format_probes(rows: list[dict], width: int = 100) -> list[str]:
    """One console line per probe: prompt -> completion, newlines shown as \\n."""
    show = lambda text: text.replace("\n", "\\n")  # noqa: E731
    return [f"  {show(r['prompt'])!s} -> {show(r['completion'])[:width]}" for r in rows]
