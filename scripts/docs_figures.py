"""The figures the docs quote from the quickstart, measured again and written where the docs say them.

    make docs-figures                              # trains the quickstart into runs/docs-figures, then:
    python scripts/docs_figures.py RUN_DIR         # reads RUN_DIR, writes docs/figures.json, rewrites
                                                   # every <!-- figure:NAME -->VALUE<!-- /figure --> in
                                                   # README.md and docs/*.md

docs/figures.json records each figure with the recipe it came from (configs/tiny-cpu.toml with every
default, as a hash): tests/unit/test_docs.py fails when a quoted figure differs from figures.json, or
when the recipe has changed since the figures were measured (run `make docs-figures` then).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
RECIPE = ROOT / "configs" / "tiny-cpu.toml"
SPAN = re.compile(r"<!-- figure:(?P<name>[\w.]+) -->(?P<value>.*?)<!-- /figure -->")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def recipe_sha256() -> str:
    """The quickstart's recipe: its config file with every default filled in, the paths left out."""
    sys.path.insert(0, str(ROOT / "src"))
    from pretrainer.config.load import load_config
    from pretrainer.config.schema import flatten

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


def quoted(pages=PAGES) -> list[tuple[Path, str, str]]:
    """(page, figure name, the value it quotes) of every figure span in the docs."""
    return [(page, m["name"], m["value"]) for page in pages for m in SPAN.finditer(page.read_text())]


def main(run_dir: Path) -> None:
    figures = measured(run_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    record = {"recipe_sha256": recipe_sha256(), "commit": commit.stdout.strip(), "figures": figures}
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
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/docs_figures.py RUN_DIR (make docs-figures trains one)")
    main(Path(sys.argv[1]))
