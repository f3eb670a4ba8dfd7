"""No writer in the package removes or replaces a path without passing the one
ownership check (core/ownership.py). Every call that removes or renames something is found in the
source; each is one of the primitives that run the check, or a run's or a command's own files, listed
here with why. A new one fails this test until it is routed through the check or listed."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "src" / "pretrainer"
REMOVING = {"rmtree", "unlink", "replace", "rename", "remove", "rmdir", "move", "removedirs"}

# (module, function) -> why it may remove or rename without check_replaceable itself
ALLOWED = {
    (
        "core/files.py",
        "atomic_file",
    ): "the primitive: with a kind it runs check_replaceable before the rename",
    ("core/files.py", "atomic_directory"): "the primitive: with a kind it runs check_replaceable first",
    ("core/files.py", "_remove_path"): "atomic_directory's: the old copy it set aside, once replaced",
    ("core/ownership.py", "remove_output"): "the check itself, then the removal",
    ("artifacts/checkpoint.py", "save_checkpoint"): "its own temp dirs left by a crash, under the run lock",
    ("artifacts/checkpoint.py", "remove_unless_pinned"): "checkpoint rotation: the run's own, under its lock",
    ("artifacts/checkpoint.py", "retire_after"): "a rollback retires the run's own newer checkpoints",
    ("artifacts/run_lock.py", "_remove_created"): "the directories this launch made, empty",
    ("train/launch.py", "launch"): "the launcher's own mkdtemp dir for the exit record",
    ("train/profiler.py", "_atomically"): "its own temp trace, renamed into the run's profile dir",
    ("analysis/calibration.py", "run_measuring_peak_rss"): "its own temp file",
    ("analysis/report/export.py", "weights_round_trip"): "its own scratch file inside the report's temp dir",
    ("analysis/machine_check.py", "disk_write_mbps"): "its own temp file",
    ("data/work_dir.py", "work_tokenizer"): "its own staging dir inside the work dir, renamed into it",
    (
        "data/work_dir.py",
        "open_work_dir",
    ): "its own staging dir, renamed to be the work dir; .old-* leftovers",
    ("data/work_dir.py", "discard_work_dir"): "the work dir renamed aside, then removed by remove_output",
    ("data/work_units.py", "finish"): "a unit's own temp files, renamed into the work dir's units/",
    ("data/work_units.py", "tokenize_unit"): "a unit's own temp file, renamed into the work dir's units/",
}
# the writers of user-visible outputs: each names its kind (or removes through the check)
OUTPUT_WRITERS = {
    ("data/prepare.py", "prepare"): 'kind="data"',
    ("data/work_dir.py", "discard_work_dir"): 'remove_output(doomed, "prepare-work")',
    ("data/hub.py", "pull"): 'kind="data"',
    ("analysis/report/export.py", "export_report"): 'kind="report"',
    ("analysis/report/export.py", "export_weights"): 'kind="safetensors"',
    ("artifacts/hf_format.py", "export_hf"): "kind=kind",
    ("artifacts/gguf_format.py", "export_gguf"): 'kind="gguf"',
    ("analysis/publish.py", "_fresh_staging"): 'remove_output(staged, "hub-push")',
}


def functions(tree):
    """(function name, node) for every def, the innermost one owning each call."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def removing_calls() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        owner = {}
        for name, node in functions(tree):
            for inner in ast.walk(node):  # ast.walk meets outer defs first: the innermost def wins
                owner[id(inner)] = name
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                is_str = isinstance(base, ast.Constant) and isinstance(base.value, str)
                text = ast.unparse(node.func)
                if node.func.attr in REMOVING and not is_str and not _string_method(text):
                    found.add((module, owner.get(id(node), "<module>")))
    return found


def _string_method(text: str) -> bool:
    """`x.replace("a", "b")` on text, `dataclasses.replace`, `datetime.replace`: not a file operation."""
    return not any(text.startswith(p) for p in ("os.", "shutil.", "Path(")) and text.endswith(".replace")


def test_every_removal_or_rename_is_the_ownership_check_s_or_a_run_s_own():
    unexplained = sorted(removing_calls() - set(ALLOWED))
    assert not unexplained, (
        f"{unexplained}: remove or replace through core/ownership.py (check_replaceable, remove_output, or "
        f"atomic_file/atomic_directory with kind=...), or list it in ALLOWED with why"
    )
    stale = sorted(set(ALLOWED) - removing_calls())
    assert not stale, f"{stale}: listed in ALLOWED but no longer removes anything; drop it"


def test_every_output_writer_names_its_kind():
    for (module, function), marker in OUTPUT_WRITERS.items():
        tree = ast.parse((PACKAGE / module).read_text())
        node = next(n for name, n in functions(tree) if name == function)
        source = ast.unparse(node).replace("'", '"')
        assert marker in source, f"{module}:{function} writes an output without {marker}"
