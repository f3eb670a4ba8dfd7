"""Do our task accuracies equal lm-evaluation-harness's? The same multiple-choice items, scored by
`pretrainer eval` on an `export --format hf` model and by `lm_eval` on it as a local task.

    pretrainer export runs/quickstart --format hf
    python benchmarks/lm_eval_agreement.py runs/quickstart/hf --task olmo:hellaswag/rc_0shot --limit 500 \
        --data-dir data/stdlib-bpe4k [--lm-eval /path/to/venv/bin/lm_eval]

The items (any multiple-choice task: a JSONL file of ours, olmo:TASK, a requests.jsonl.gz) are
written as a JSON dataset and a task YAML for lm-eval: doc_to_text = the context, doc_to_choice =
the choices with their leading space and target_delimiter "", so both tools score the same
continuation text and normalise by the same characters (lm-eval's acc_norm = our accuracy_norm).
Prints both accuracies, their differences in points, and how many items' predictions differ.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def lm_eval_scores(
    hf_dir: Path, items: list[dict], work: Path, lm_eval: str, batch_size: int
) -> tuple[dict, list[dict]]:
    """Run lm_eval on the items as a local task -> ({"acc", "acc_norm"}, its per-item records)."""
    name = "pretrainer_agreement"
    data = work / "items.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": it["context"], "choices": it["choices"], "gold": it["gold"]}) + "\n"
            for it in items
        )
    )
    (work / "tasks").mkdir()
    (work / "tasks" / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data))
    command = [
        lm_eval,
        "--model",
        "hf",
        "--model_args",
        f"pretrained={hf_dir},dtype=float32",
        "--device",
        "cpu",
        "--include_path",
        str(work / "tasks"),
        "--tasks",
        name,
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(work / "out"),
        "--log_samples",
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(
        command,
        check=True,
        env={
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PATH": str(Path(lm_eval).parent) + ":/usr/bin:/bin",
            "HOME": str(work),
        },
    )
    results = json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"][name]
    samples = [
        json.loads(line)
        for line in next((work / "out").rglob(f"samples_{name}_*.jsonl")).read_text().splitlines()
    ]
    return {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"]}, sorted(
        samples, key=lambda s: s["doc_id"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="a model written by `pretrainer export RUN --format hf`")
    parser.add_argument(
        "--task",
        required=True,
        help="a multiple-choice task: FILE.jsonl, olmo:TASK[/VARIANT], requests.jsonl.gz",
    )
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument(
        "--lm-eval", default=shutil.which("lm_eval") or "lm_eval", help="the lm_eval executable"
    )
    parser.add_argument(
        "--data-dir", required=True, help="a prepared data dir with the model's tokenizer (and val split)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    from pretrainer.eval.task_files import load_task
    from pretrainer.eval.verb import evaluate_target

    task = load_task(args.task, limit=args.limit)
    items = [it for it in task.items if it["type"] == "mc"]
    if len(items) != len(task.items):
        sys.exit(
            f"{args.task}: only multiple-choice items compare directly; {len(task.items) - len(items)} are "
            f"not"
        )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours_file = work / "ours.jsonl"
        ours_file.write_text("".join(json.dumps(it) + "\n" for it in items))
        ours = evaluate_target(
            f"hf:{args.hf_dir}",
            [f"--eval.tasks={ours_file}", "--eval.probe_tokens=1", f"--data.dir={args.data_dir}"],
            out=str(work / "ours.json"),
            limit=0,
        )["tasks"][0]
        theirs, samples = lm_eval_scores(
            Path(args.hf_dir).resolve(), items, work, args.lm_eval, args.batch_size
        )
    print(f"\n{task.name}: {len(items)} items (multiple choice, {task.num_fewshot}-shot contexts as given)")
    print(f"{'':<10} {'pretrainer':>11} {'lm-eval':>9} {'diff (points)':>14}")
    for ours_key, their_key in (("accuracy", "acc"), ("accuracy_norm", "acc_norm")):
        print(
            f"{their_key:<10} {ours[ours_key]:>11.4f} {theirs[their_key]:>9.4f} "
            f"{100 * (ours[ours_key] - theirs[their_key]):>+14.2f}"
        )
    # per item: each choice's log-likelihood by our scorer against lm-eval's logged one
    import torch

    from pretrainer.artifacts.runs import build_model, init_source
    from pretrainer.config.schema import Config
    from pretrainer.data.data_dir import open_data_dir
    from pretrainer.eval.tasks import continuation_scorer, encode_task

    model_cfg, load = init_source(f"hf:{args.hf_dir}")
    model = build_model(Config(model=model_cfg), load).eval()
    tokenizer = open_data_dir(args.data_dir).tokenizer
    scores = continuation_scorer(model, model_cfg.seq_len, torch.device("cpu"), None)(
        encode_task(task, tokenizer)
    )
    gaps = [
        abs(ll - float(theirs_choice[0][0]))
        for item_scores, sample in zip(scores, samples)
        for (ll, _), theirs_choice in zip(item_scores, sample["resps"])
    ]
    differ = sum(
        max(range(len(s)), key=lambda i: s[i][0]) != max(range(len(r)), key=lambda i: float(r[i][0][0]))
        for s, r in zip(scores, (sample["resps"] for sample in samples))
    )
    print(
        f"per choice |log-likelihood ours - lm-eval|: max {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e} "
        f"over "
        f"{len(gaps)} choices; items whose summed-likelihood choice differs: {differ} of {len(items)}"
    )


if __name__ == "__main__":
    main()
