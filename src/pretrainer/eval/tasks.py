"""In-context tasks, scored by the model's likelihoods, in the three formats CORE uses.

    items = read_task_file("tasks/copa.jsonl")
    result = score_task("copa", items, continuation_scorer(model, device, amp_dtype), tokenizer, num_fewshot=3)

One JSON object per line (our own format; the text is used exactly as written, so a choice that
follows "Answer:" carries its leading space):
    {"type": "mc", "context": "...", "choices": ["...", "..."], "gold": 0}         one context, choices scored
    {"type": "schema", "contexts": ["...", "..."], "continuation": "...", "gold": 1}  several contexts, one continuation
    {"type": "lm", "context": "...", "continuation": "..."}                          greedy continuation must match

Multiple choice reports two accuracies: by the summed log-likelihood of each choice, and by that sum
divided by the choice's characters (lm-evaluation-harness's acc_norm); the task's score is the
latter. Centered accuracy = (accuracy - chance) / (1 - chance), chance = the mean of 1 / choices
(0 for language modelling); a suite's score is the mean centered accuracy over its tasks.
Few-shot examples are other items of the same task, drawn with a fixed seed per item, each written
as its context plus its gold continuation, separated by a blank line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

from pretrainer.device import autocast
from pretrainer.errors import UserError

TASK_TYPES = ("mc", "schema", "lm")
FEWSHOT_SEPARATOR = "\n\n"

# (context ids, continuation ids) pairs -> (sum of log p(continuation | context), greedy == continuation) each
Scorer = Callable[[list[tuple[list[int], list[int]]]], list[tuple[float, bool]]]


def read_task_file(path: str | Path) -> list[dict]:
    """The items of a task file (one JSON object per line), checked: one-line errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: task file not found")
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            problem = _item_problem(item)
        except json.JSONDecodeError as e:
            problem = f"not JSON ({e.msg})"
        if problem:
            raise UserError(f"{path}:{number}: {problem}; see the task format in src/pretrainer/eval/tasks.py")
        items.append(item)
    if not items:
        raise UserError(f"{path}: no items")
    return items


def _item_problem(item) -> str:
    if not isinstance(item, dict) or item.get("type") not in TASK_TYPES:
        return f"'type' must be one of {', '.join(TASK_TYPES)}"
    options = item.get("choices") if item["type"] == "mc" else item.get("contexts") if item["type"] == "schema" else None
    if item["type"] != "lm" and not (isinstance(options, list) and len(options) >= 2
                                     and isinstance(item.get("gold"), int) and 0 <= item["gold"] < len(options)):
        return "needs a list of at least 2 choices/contexts and a 'gold' index into it"
    return ""


def gold_text(item: dict) -> tuple[str, str]:
    """(context, continuation) of the item's correct answer: how it reads as a few-shot example."""
    if item["type"] == "mc":
        return item["context"], item["choices"][item["gold"]]
    if item["type"] == "schema":
        return item["contexts"][item["gold"]], item["continuation"]
    return item["context"], item["continuation"]


def fewshot_prefix(items: list[dict], index: int, num_fewshot: int, seed: int) -> str:
    others = [i for i in range(len(items)) if i != index]
    chosen = random.Random(seed * 1_000_003 + index).sample(others, min(num_fewshot, len(others)))
    return "".join("".join(gold_text(items[i])) + FEWSHOT_SEPARATOR for i in chosen)


def score_task(name: str, items: list[dict], scorer: Scorer, tokenizer, num_fewshot: int = 0, seed: int = 1234) -> dict:
    """Accuracy (and per-character normalised accuracy for multiple choice), chance and centered
    accuracy of one task; each item's choices are scored in one batch."""
    correct, correct_norm, chance = 0, 0, 0.0
    for index, item in enumerate(items):
        prefix = fewshot_prefix(items, index, num_fewshot, seed)
        if item["type"] == "mc":
            context = tokenizer.encode(prefix + item["context"])
            scores = scorer([(context, tokenizer.encode(choice)) for choice in item["choices"]])
            sums = [s for s, _ in scores]
            per_char = [s / max(len(choice), 1) for s, choice in zip(sums, item["choices"])]
            correct += argmax(sums) == item["gold"]
            correct_norm += argmax(per_char) == item["gold"]
            chance += 1 / len(item["choices"])
        elif item["type"] == "schema":
            continuation = tokenizer.encode(item["continuation"])
            scores = scorer([(tokenizer.encode(prefix + context), continuation) for context in item["contexts"]])
            hit = argmax([s for s, _ in scores]) == item["gold"]
            correct, correct_norm, chance = correct + hit, correct_norm + hit, chance + 1 / len(item["contexts"])
        else:
            (_, greedy_matches), = scorer([(tokenizer.encode(prefix + item["context"]), tokenizer.encode(item["continuation"]))])
            correct, correct_norm = correct + greedy_matches, correct_norm + greedy_matches
    n = len(items)
    accuracy, accuracy_norm, chance = correct / n, correct_norm / n, chance / n
    return {"task": name, "items": n, "num_fewshot": num_fewshot, "accuracy": accuracy, "accuracy_norm": accuracy_norm,
            "chance": chance, "centered": (accuracy_norm - chance) / (1 - chance)}


def suite_score(results: list[dict]) -> float:
    """The mean centered accuracy over the tasks."""
    return sum(r["centered"] for r in results) / len(results)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def continuation_scorer(model: torch.nn.Module, device: torch.device, amp_dtype: torch.dtype | None) -> Scorer:
    """A Scorer over our model: the pairs of one call run as one right-padded batch (causal attention:
    padding after a sequence does not change it). A pair longer than model.seq_len + 1 keeps its end."""
    seq_len = model.cfg.seq_len

    @torch.no_grad()
    def score(pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        rows = []
        for context, continuation in pairs:
            if not continuation:
                raise UserError("a task item has an empty continuation or choice")
            ids = (context + continuation)[-(seq_len + 1):]
            rows.append((ids, min(len(continuation), len(ids) - 1)))
        x = torch.zeros(len(rows), max(len(ids) for ids, _ in rows) - 1, dtype=torch.long)
        for i, (ids, _) in enumerate(rows):
            x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        model.eval()
        with autocast(device, amp_dtype):
            logits, _ = model(x.to(device))
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, (ids, n) in enumerate(rows):
            positions = torch.arange(len(ids) - 1 - n, len(ids) - 1, device=log_probs.device)
            targets = torch.tensor(ids[-n:], device=log_probs.device)
            total = log_probs[i, positions, targets].sum().item()
            out.append((total, bool((logits[i, positions].argmax(-1) == targets).all())))
        return out

    return score
