"""Synthetic conversations for the SFT tests: string reversal (held-out strings measure whether the
model learned the skill, not the answers) and single-digit sums (so "What is 2+3?" has an answer)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

LETTERS = "abcdefgh"


def reversal_items(seed: int = 0) -> list[tuple[str, str]]:
    """Every string of 3 or 4 letters from LETTERS, as (question, answer), shuffled."""
    items = []
    for length in (3, 4):
        for letters in itertools.product(LETTERS, repeat=length):
            items.append((f"reverse: {' '.join(letters)}", " ".join(reversed(letters))))
    random.Random(seed).shuffle(items)
    return items


def sum_items() -> list[tuple[str, str]]:
    return [(f"What is {a}+{b}?", str(a + b)) for a in range(10) for b in range(10)]


def conversation(question: str, answer: str, system: str = "") -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]
    return {"messages": messages}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def split_reversal(
    n_held_out: int = 100, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train items, held-out items): the held-out strings never appear in the training conversations."""
    items = reversal_items(seed)
    return items[n_held_out:], items[:n_held_out]


if __name__ == "__main__":  # python tests/chat_tasks.py DIR: the README's SFT example data
    import sys

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    train_items, held_out = split_reversal()
    write_jsonl(out / "text.jsonl", [{"text": f"{q} {a}"} for q, a in train_items[:1500]])
    write_jsonl(
        out / "chat.jsonl",
        [conversation(q, a) for q, a in train_items] + [conversation(q, a) for q, a in sum_items()],
    )
    write_jsonl(out / "held-out.jsonl", [conversation(q, a) for q, a in held_out])
    print(
        f"wrote {out}/text.jsonl (base model text), chat.jsonl ({len(train_items) + 100} conversations), "
        f"held-out.jsonl"
    )
