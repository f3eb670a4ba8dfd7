"""The docs name only what exists: README.md and docs/*.md checked against the code.

Every `--section.key` is a config key, every `pretrainer VERB` a verb and every `--flag` after it an
option of that verb, every relative link a file (and heading), the README short with the two
commands at the top, the configuration page's key table complete, the architecture page's module map
naming every module of src/pretrainer and nothing else, and no internal issue numbers.
Fast: reads the markdown and builds the argument parser, no subprocess, no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from collections import Counter
from pathlib import Path

from pretrainer.analysis.scaling.ladder import SweepConfig
from pretrainer.cli.parser import build_parser
from pretrainer.config.doc import type_and_range
from pretrainer.config.keys import AUTO_NUMBERS, all_keys, key_help, to_dict
from pretrainer.config.schema import Config
from pretrainer.config.toml_text import toml_value as toml_literal

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "pretrainer"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

README_MAX_LINES = 250
TOP_LINES = 40
PLACEHOLDER_KEYS = {"section.key", "sweep.key"}  # the docs' names for "any key"
TABLE_START, TABLE_END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"
MAP_HEADING = "## Module map"
NOT_MODULES = {"__init__.py", "__main__.py"}  # a package's plumbing, not listed

DOTTED = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*\.[a-z][a-z0-9_-]*)")
VERB = re.compile(r"(?<![\w.-])pretrainer\s+([a-z][a-z0-9-]*)")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)(?![\w.])")
SEGMENT_END = re.compile(r"\||&&|;|(?:^|\s)#")  # where a shell line stops being the pretrainer command
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"`([^`]+)`")
# a module map line: indent, a dir (`tokenizers/`) or module (`loop.py`, `report/export.py`), description
MAP_ENTRY = re.compile(r"( *)((?:[\w-]+/)*(?:[\w-]+/|[\w-]+\.py))(?:\s+(\S.*))?$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the text with fenced code blanked out, line numbers kept; the fenced lines as (line, text)
    with backslash continuations joined onto the line they start)."""
    prose, code, fenced, pending = [], [], False, None
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
            continue
        if not fenced:
            prose.append(line)
            continue
        prose.append("")
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
        else:
            code.append(pending)
            pending = None
    return "\n".join(prose), code


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def commands(path: Path) -> list[tuple[int, str]]:
    """Every piece of code on a page, as (line, text): fenced lines and inline code spans."""
    prose, code = split_fences(path.read_text(encoding="utf-8"))
    inline = [(line_of(prose, m.start()), m.group(1).replace("\n", " ")) for m in INLINE.finditer(prose)]
    return code + inline


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subparsers) == 1, "the CLI should have one set of verbs"
    return dict(subparsers[0].choices)


def verb_uses(path: Path, verbs: dict) -> list[tuple[int, str, str]]:
    """(line, verb, the rest of its command) for `pretrainer VERB ...` in code, and for inline code
    that starts with a verb and an option (`plan --fit`, `export --format hf`)."""
    uses = []
    for number, text in commands(path):
        for m in VERB.finditer(text):
            rest = text[m.end() :]
            end = SEGMENT_END.search(rest)
            uses.append((number, m.group(1), rest[: end.start()] if end else rest))
        first = re.match(r"([a-z][a-z0-9-]*)(\s+--.*)$", text)
        if first and first.group(1) in verbs and not VERB.search(text):
            end = SEGMENT_END.search(first.group(2))
            uses.append((number, first.group(1), first.group(2)[: end.start()] if end else first.group(2)))
    return uses


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen, out = Counter(), set()
    for line in prose.split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def toml_value(value) -> str:
    if isinstance(value, list) and all(isinstance(word, str) for word in value):  # on one line
        return "[" + ", ".join(toml_value(word) for word in value) + "]"
    return toml_literal(value)


def key_row(key: str) -> str:
    """The row the configuration page should have for a key (the code's type, default and help)."""
    section, name = key.split(".", 1)
    default = to_dict(Config())[section][name]
    if key in AUTO_NUMBERS and default == AUTO_NUMBERS[key]:
        default = "auto"  # as a config writes it
    help_text = key_help()[key].replace("|", "\\|")
    return f"| `{key}` | {type_and_range(key)} | `{toml_value(default)}` | {help_text} |"


def map_entries(lines: list[str], first_line: int = 1) -> list[tuple[int, str]]:
    """(line, path from the repo root) for each dir and module a module map names. A dir line opens a
    package at its indentation; a line indented less or as much closes it. A line that starts at or
    right of the descriptions' column (the leftmost one so far), or with no dir or module name,
    continues a description, whatever its first word."""
    entries, packages, descriptions_at = [], [], None  # packages: (indent, path) from the outermost
    for number, line in enumerate(lines, first_line):
        indent = len(line) - len(line.lstrip(" "))
        m = MAP_ENTRY.match(line)
        if not m or (descriptions_at is not None and indent >= descriptions_at):
            continue
        while packages and packages[-1][0] >= indent:
            packages.pop()
        path = (packages[-1][1] if packages else "") + m.group(2)
        if path.endswith("/"):
            packages.append((indent, path))
        if m.group(3):
            descriptions_at = min(m.start(3), descriptions_at or m.start(3))
        entries.append((number, path))
    return entries


def module_map() -> list[tuple[int, str]]:
    """The entries of the architecture page's "Module map" code block, as map_entries gives them."""
    lines = ARCHITECTURE.read_text(encoding="utf-8").split("\n")
    assert MAP_HEADING in lines, f"{rel(ARCHITECTURE)}: no '{MAP_HEADING}' heading"
    fences = [i for i in range(lines.index(MAP_HEADING), len(lines)) if lines[i].lstrip().startswith("```")]
    assert len(fences) >= 2, f"{rel(ARCHITECTURE)}: no code block after '{MAP_HEADING}'"
    return map_entries(lines[fences[0] + 1 : fences[1]], first_line=fences[0] + 2)


def fail_if(problems: list[str], what: str) -> None:
    assert not problems, f"{what}:\n  " + "\n  ".join(problems)


def test_dotted_options_are_config_keys():
    keys = set(all_keys()) | {f"sweep.{f.name}" for f in dataclasses.fields(SweepConfig)} | PLACEHOLDER_KEYS
    problems = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in DOTTED.finditer(text):
            if m.group(1) not in keys:
                near = difflib.get_close_matches(m.group(1).replace("-", "_"), sorted(keys), n=3)
                problems.append(
                    f"{rel(path)}:{line_of(text, m.start())}: --{m.group(1)} is not a config key"
                    + (f" (did you mean {', '.join('--' + k for k in near)}?)" if near else "")
                )
    fail_if(problems, "options that name no config key (spell keys as all_keys() does: init.from, max_steps)")


def test_verbs_exist():
    verbs = verb_parsers()
    problems = [
        f"{rel(path)}:{number}: `pretrainer {verb}`: no such verb (verbs: {', '.join(verbs)})"
        for path in PAGES
        for number, verb, _ in verb_uses(path, verbs)
        if verb not in verbs
    ]
    fail_if(problems, "verbs the CLI does not have")


def test_flags_belong_to_their_verb():
    verbs = verb_parsers()
    problems = []
    for path in PAGES:
        for number, verb, rest in verb_uses(path, verbs):
            if verb not in verbs:
                continue  # test_verbs_exist says so
            options = {s for action in verbs[verb]._actions for s in action.option_strings}
            for m in FLAG.finditer(rest):
                if f"--{m.group(1)}" not in options:
                    near = difflib.get_close_matches(f"--{m.group(1)}", sorted(options), n=3)
                    problems.append(
                        f"{rel(path)}:{number}: `pretrainer {verb}` has no --{m.group(1)}"
                        + (f" (did you mean {', '.join(near)}?)" if near else "")
                    )
    fail_if(problems, "options a verb does not take")


def test_relative_links_resolve():
    problems = []
    for path in PAGES:
        prose, _ = split_fences(path.read_text(encoding="utf-8"))
        prose = INLINE.sub(lambda m: " " * len(m.group(0)), prose)
        for m in LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{rel(path)}:{line_of(prose, m.start())}: ({target})"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    fail_if(problems, "broken relative links")


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    top = "\n".join(lines[:TOP_LINES])
    problems = []
    if len(lines) > README_MAX_LINES:
        problems.append(
            f"README.md has {len(lines)} lines; at most {README_MAX_LINES} (move detail to docs/)"
        )
    for command in ("make quickstart", "make test"):
        if not re.search(re.escape(command) + r"(?![\w-])", top):
            problems.append(f"README.md does not name `{command}` in its first {TOP_LINES} lines")
    fail_if(problems, "the README")


def test_configuration_page_lists_every_key_once():
    text = CONFIG_PAGE.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, (
        f"{rel(CONFIG_PAGE)}: the markers {TABLE_START} / {TABLE_END} are missing"
    )
    table = text[text.index(TABLE_START) : text.index(TABLE_END)]
    rows = {}
    listed = Counter()
    for line in table.split("\n"):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) >= 3 and cells[0].startswith("`"):
            key = cells[0].strip("`")
            listed[key] += 1
            rows[key] = cells
    keys = all_keys()
    problems = [f"`{k}` is listed {n} times" for k, n in listed.items() if n > 1]
    problems += [f"`{k}` is not a config key: remove its row" for k in listed if k not in keys]
    for key in keys:
        expected = [c.strip() for c in re.split(r"(?<!\\)\|", key_row(key))[1:-1]]
        if key not in rows:
            problems.append(f"`{key}` is missing; its row:\n    {key_row(key)}")
        elif rows[key][1:3] != expected[1:3]:
            problems.append(
                f"`{key}`: the page says type {rows[key][1]}, default {rows[key][2]}; the code "
                f"{expected[1]}, {expected[2]}; its row:\n    {key_row(key)}"
            )
    fail_if(problems, f"{rel(CONFIG_PAGE)}: the key table between the config-keys markers")


def test_no_internal_issue_numbers():
    problems = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        problems += [f"{rel(path)}:{line_of(text, m.start())}: '{m.group(0)}'" for m in ISSUE.finditer(text)]
    fail_if(problems, "internal issue numbers (say what changed instead)")


def test_module_map_reads_dirs_relative_paths_and_continuations():
    block = [
        "src/pretrainer/",
        "  core/                   the bottom layer",
        "    errors.py             UserError and",
        "                          every exit code",
        "  data/",
        "    tokenizers/",
        "      bpe.py              GPT-2 via tiktoken; save/load, with",
        "                          tokenizer.json beside ours",
        "    loader.py             token stream",
        "  analysis/",
        "    report/export.py      the run report",
        "    report/serve_cost_tables.py  serve-cost's tables",
        "                          more.py of the description",
        "    plan.py               pre-launch arithmetic",
        "benchmarks/               throughput, prepare vs tiktoken",
        "                          checkpoint.py verification cost",
    ]
    assert [path for _, path in map_entries(block)] == [
        "src/pretrainer/",
        "src/pretrainer/core/",
        "src/pretrainer/core/errors.py",
        "src/pretrainer/data/",
        "src/pretrainer/data/tokenizers/",
        "src/pretrainer/data/tokenizers/bpe.py",
        "src/pretrainer/data/loader.py",
        "src/pretrainer/analysis/",
        "src/pretrainer/analysis/report/export.py",
        "src/pretrainer/analysis/report/serve_cost_tables.py",
        "src/pretrainer/analysis/plan.py",
        "benchmarks/",
    ]


def test_module_map_lists_every_module():
    root = rel(PACKAGE) + "/"
    listed = [(number, path.removeprefix(root)) for number, path in module_map() if path.startswith(root)]
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name not in NOT_MODULES}
    names = Counter(path for _, path in listed)
    problems = [
        f"{module}: missing; list it under {module.rpartition('/')[0] or rel(PACKAGE)}/ with a one-line "
        "description (its docstring's gist)"
        for module in sorted(modules - set(names))
    ]
    problems += [
        f"{rel(ARCHITECTURE)}:{number}: {path}: no such {'package' if path.endswith('/') else 'module'} "
        f"in {rel(PACKAGE)}: remove or correct the line"
        for number, path in listed
        if path and not (path in modules or path.endswith("/") and (PACKAGE / path).is_dir())
    ]
    problems += [
        f"{rel(ARCHITECTURE)}:{', '.join(str(number) for number, p in listed if p == path)}: {path}: "
        f"listed {n} times"
        for path, n in names.items()
        if n > 1
    ]
    fail_if(problems, f"{rel(ARCHITECTURE)}: the '{MAP_HEADING}' block against the modules of {rel(PACKAGE)}")


def test_quoted_quickstart_figures_are_the_measured_ones_of_today_s_recipe():
    """Every <!-- figure:NAME --> span in README and docs quotes docs/figures.json, and figures.json was
    measured with today's quickstart recipe (configs/tiny-cpu.toml and every default) and today's SFT
    worked example (docs/later-stages.md's commands): a changed recipe or a hand-edited figure fails
    here until `make docs-figures` measures them again."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
    figures_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures_script)
    record = json.loads((ROOT / "docs" / "figures.json").read_text())
    assert record["recipe_sha256"] == figures_script.recipe_sha256(), (
        "the quickstart's recipe changed since docs/figures.json was measured: run `make docs-figures`"
    )
    assert record["sft_recipe_sha256"] == figures_script.sft_recipe_sha256(), (
        "docs/later-stages.md's worked example changed since docs/figures.json was measured: run "
        "`make docs-figures`"
    )
    quoted = figures_script.quoted()
    names = {name for _, name, _ in quoted}
    assert names >= {"quickstart.val_loss_start", "quickstart.val_loss_end", "sft.held_out_right"}
    wrong = [
        f"{rel(page)}: {name} = {value}" for page, name, value in quoted if record["figures"][name] != value
    ]
    assert not wrong, f"{wrong}: not docs/figures.json's; run `make docs-figures`"
