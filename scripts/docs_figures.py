"""The figures the docs quote from the quickstart (its training, its serve-cost tables) and the SFT
worked example, measured again and written where the docs say them.

    make docs-figures                              # trains the quickstart into runs/docs-figures, then:
    python scripts/docs_figures.py RUN_DIR --sft WORK  # reads RUN_DIR; runs later-stages.md's worked
                                                   # example in WORK and scores it; writes docs/figures.json
                                                   # and every <!-- figure:NAME -->VALUE<!-- /figure --> in
                                                   # README.md and docs/*.md

The worked example runs as docs/later-stages.md writes it (its code block, line for line), and is
scored the way it says: the held-out prompts piped into `chat --temperature 0`, one per line.
docs/figures.json records each figure with the recipes it came from (configs/tiny-cpu.toml with every
default, and the example's commands, as hashes): tests/unit/test_docs.py fails when a quoted figure
differs from figures.json, or when a recipe has changed since (run `make docs-figures` then).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
RECIPE = ROOT / "configs" / "tiny-cpu.toml"
SPAN = re.compile(r"<!-- figure:(?P<name>[\w.]+) -->(?P<value>.*?)<!-- /figure -->", re.S)  # tables: lines
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SFT_PAGE, SFT_HEADING = ROOT / "docs" / "later-stages.md", "## A worked example on CPU"


def recipe_sha256() -> str:
    """The quickstart's recipe: its config file with every default filled in, the paths left out."""
    sys.path.insert(0, str(ROOT / "src"))
    from pretrainer.config.keys import flatten
    from pretrainer.config.load import load_config

    flat = flatten(load_config(RECIPE, []))
    flat = {k: v for k, v in flat.items() if k not in ("data.dir", "run.dir")}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def measured(run_dir: Path) -> dict[str, str]:
    """The quickstart's figures from its run dir, formatted as the docs quote them."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    val = [r for r in records if "val_loss" in r]
    trained = [r for r in records if "loss" in r]
    seconds = max(r["elapsed_s"] for r in records if "elapsed_s" in r)
    tokens = trained[-1]["tokens"]
    return {
        "quickstart.val_loss_start": f"{val[0]['val_loss']:.4f}",
        "quickstart.val_loss_end": f"{val[-1]['val_loss']:.4f}",
        "quickstart.steps": f"{val[-1]['step']:,}",
        "quickstart.train_seconds": f"{seconds:.1f}",
        "quickstart.tokens_per_s": f"{tokens / seconds:,.0f}",
    }


def sft_commands() -> str:
    """The worked example's commands: the first code block under its heading in docs/later-stages.md."""
    text = SFT_PAGE.read_text()
    block = re.search(r"```\n(.*?)```", text[text.index(SFT_HEADING) :], re.S)
    return block.group(1)


def sft_recipe_sha256() -> str:
    """The worked example's recipe: its commands and every default (the quickstart's recipe hash)."""
    return hashlib.sha256((sft_commands() + recipe_sha256()).encode()).hexdigest()


def sft_measured(work: Path) -> dict[str, str]:
    """Run the worked example in `work` as written (its relative paths land there), score the held-out
    prompts through piped `chat`, and return its figures."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "tests").symlink_to(ROOT / "tests")  # `python tests/chat_tasks.py` as from the checkout
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", sft_commands()], cwd=work, env=env, check=True)
    held_out = [json.loads(line)["messages"] for line in (work / "data/rev/held-out.jsonl").open()]
    prompts = "".join(m[0]["content"] + "\n" for m in held_out)
    chat = ["pretrainer", "chat", "runs/rev-sft", "--temperature", "0", "--max-new-tokens", "12"]
    replies = subprocess.run(
        chat, cwd=work, env=env, input=prompts, capture_output=True, text=True, check=True
    )
    right = sum(r.strip() == m[1]["content"] for r, m in zip(replies.stdout.splitlines(), held_out))
    records = [json.loads(line) for line in (work / "runs/rev-sft/metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    trained = [r for r in records if "loss" in r]
    return {
        "sft.steps": f"{trained[-1]['step']:,}",
        "sft.train_seconds": f"{max(r['elapsed_s'] for r in records if 'elapsed_s' in r):.0f}",
        "sft.tokens": f"{trained[-1]['tokens']:,}",
        "sft.val_loss_start": f"{val[0]['val_loss']:.2f}",
        "sft.val_loss_end": f"{val[-1]['val_loss']:.2f}",
        "sft.held_out_right": f"{right}",
        "sft.held_out": f"{len(held_out)}",
    }


def serve_cost_measured(run_dir: Path) -> dict[str, str]:
    """`serve-cost` on the quickstart's run as evaluation.md quotes it: its time and its two tables."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    started = time.perf_counter()
    subprocess.run(["pretrainer", "serve-cost", str(run_dir), "--usd-per-hour", "0.10"], env=env, check=True)
    seconds = time.perf_counter() - started
    text = (run_dir / "report" / "serve_cost.md").read_text()
    tables = {}
    for heading, name in (("## Weights and quality", "quality"), ("## Speed and cost", "speed")):
        section = text[text.index(heading) :].split("\n## ")[0]
        rows = [line for line in section.splitlines() if line.startswith("|")]
        tables[f"serve_cost.{name}_table"] = "\n" + "\n".join(rows) + "\n\n"  # a blank line ends the table
    return {"serve_cost.seconds": f"{seconds:.0f}", **tables}


def quoted(pages=PAGES) -> list[tuple[Path, str, str]]:
    """(page, figure name, the value it quotes) of every figure span in the docs."""
    return [(page, m["name"], m["value"]) for page in pages for m in SPAN.finditer(page.read_text())]


def main(run_dir: Path, sft_work: Path) -> None:
    figures = measured(run_dir) | serve_cost_measured(run_dir) | sft_measured(sft_work)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    record = {
        "recipe_sha256": recipe_sha256(),
        "sft_recipe_sha256": sft_recipe_sha256(),
        "commit": commit.stdout.strip(),
        "figures": figures,
    }
    FIGURES.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for page in PAGES:
        text = page.read_text()
        new = SPAN.sub(
            lambda m: f"<!-- figure:{m['name']} -->{figures.get(m['name'], m['value'])}<!-- /figure -->", text
        )
        if new != text:
            page.write_text(new)
            print(f"updated {page.relative_to(ROOT)}")
    print(f"wrote {FIGURES.relative_to(ROOT)}: {figures}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the quickstart's run (make docs-figures trains one)")
    parser.add_argument("--sft", type=Path, required=True, help="a scratch dir for the SFT worked example")
    arguments = parser.parse_args()
    main(arguments.run_dir, arguments.sft)
