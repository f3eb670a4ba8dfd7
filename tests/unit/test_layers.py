"""The package's shape: packages in layers at the top (nothing else), and no import cycle between any
two modules. Which layer may import which is import-linter's job (`make lint`, pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest

# import-linter's graph library, a dev dependency: a site image running the cuda tests may lack it
grimp = pytest.importorskip("grimp")

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "pretrainer"
LAYERS = {"core", "config", "model", "data", "optim", "artifacts", "eval", "train", "analysis", "cli"}


def test_only_the_layers_and_the_entry_points_sit_at_the_top():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert modules == {"__init__.py", "__main__.py"}, modules
    assert packages == LAYERS, packages


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other, directly or not."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_no_two_modules_import_each_other():
    imports = grimp.build_graph("pretrainer", cache_dir=None)
    graph = {m: imports.find_modules_directly_imported_by(m) & imports.modules for m in imports.modules}
    cycles = [sorted(group) for group in strongly_connected(graph) if len(group) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(g) for g in strongly_connected(graph) if len(g) > 1] == [["a", "b", "c"]]
