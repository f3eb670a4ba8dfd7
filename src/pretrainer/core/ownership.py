"""What a writer may replace: the one rule every writer that replaces or removes a user's path passes
(`prepare --force` and `--from-hub --force`, `export` in every format, the Hub push's staging).

A writer replaces only what it can prove it wrote itself for this purpose, by a marker it owns:
- a directory output holds OUTPUT_MARKER (`.pretrainer-output`, {"output": KIND}); a data dir's and a
  report's manifest.json, which only pretrainer writes, prove it too (outputs older than the marker);
- a file output carries the marker in its own metadata (safetensors `__metadata__`, a GGUF key): never
  its extension or magic number, which any tool writes.
Whatever the marker says, it never writes
- through a symlink (what a link points at is not the writer's to replace),
- inside a checkpoint, a run's checkpoints/ or a data dir (the push's staging beside its source aside),
- over a tree that holds a run dir, a checkpoint or another data dir,
- over the working directory, one of the command's inputs (`keep`), or a parent of one.
(A run's own files, checkpoints included, are its trainer's: the run-dir lock is their ownership check.)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from pretrainer.core.errors import UserError

OUTPUT_MARKER = ".pretrainer-output"
FILE_MARKER_KEY = "pretrainer_output"  # safetensors metadata; GGUF: "pretrainer.output"
GGUF_MARKER_KEY = "pretrainer.output"

# kind -> what it is, in an error line
OUTPUTS = {
    "data": "a prepared data dir",
    "prepare-work": "a prepare's work dir",
    "report": "a report",
    "hf": "a Hugging Face export",
    "hub-push": "a Hub push's staging",
    "safetensors": "a safetensors export",
    "gguf": "a GGUF export",
}
FILE_OUTPUTS = ("safetensors", "gguf")
MARKER_NAMES = {False: f"{OUTPUT_MARKER} file", True: f"{FILE_MARKER_KEY} key in its metadata"}


def json_object(path: Path) -> dict:
    """A JSON object file's content (a manifest, a marker, an eval record); {} for a missing or
    unreadable one."""
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def json_keys(path: Path) -> set[str]:
    """The top-level keys of a JSON object file; none for a missing or unreadable one."""
    return set(json_object(path))


def is_data_dir(path: Path) -> bool:
    """A directory `prepare` wrote: its manifest names the splits and the tokenizer."""
    return {"splits", "tokenizer"} <= json_keys(Path(path) / "manifest.json")


def is_run_dir(path: Path) -> bool:
    """A directory a trainer took: its lock file, its checkpoints/ or its metrics."""
    path = Path(path)
    return (path / ".lock").is_file() or (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint: its completion marker, or its trainer state beside its weights (one mid-write)."""
    path = Path(path)
    return (path / "COMPLETE").is_file() or (
        (path / "state.json").is_file() and (path / "model.safetensors").is_file()
    )


_LEGACY = {  # directory outputs written before OUTPUT_MARKER: their manifest, which only pretrainer writes
    "data": is_data_dir,
    "report": lambda path: "final_weights" in json_keys(path / "manifest.json"),
}


def file_marker(path: Path) -> str | None:
    """The output kind a file's own metadata names (safetensors or GGUF), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:4] == b"GGUF":
                return _gguf_marker(path)
            if len(head) < 8 or not 2 <= (size := struct.unpack("<Q", head)[0]) <= 100 << 20:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    found = metadata.get(FILE_MARKER_KEY) if isinstance(metadata, dict) else None
    return found if isinstance(found, str) else None


def _gguf_marker(path: Path) -> str | None:
    try:
        import gguf

        field = gguf.GGUFReader(path).fields.get(GGUF_MARKER_KEY)
        return None if field is None else bytes(field.parts[field.data[0]]).decode()
    except Exception:  # no gguf package, a damaged file: not provably ours
        return None


def owned(path: Path, kind: str) -> bool:
    """Whether `path` carries the marker of a `kind` output pretrainer wrote."""
    path = Path(path)
    if path.is_symlink():
        return False
    if kind in FILE_OUTPUTS:
        return path.is_file() and file_marker(path) == kind
    if not path.is_dir():
        return False
    marked = _read_marker(path / OUTPUT_MARKER)
    return marked == kind or (marked is None and kind in _LEGACY and _LEGACY[kind](path))


def _read_marker(path: Path) -> str | None:
    found = json_object(path).get("output")
    return found if isinstance(found, str) else None


def mark_output(directory: Path, kind: str) -> None:
    """Mark a directory output as `kind` (in its temp directory, before it is renamed into place)."""
    marker = {"output": kind, "written_by": "pretrainer"}
    (Path(directory) / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n")


def _held_inside(target: Path) -> tuple[str, Path] | None:
    """What a path lies inside of that no output may be written into: (what, where), or None."""
    for parent in target.parents:
        if is_checkpoint_dir(parent):
            return "the checkpoint", parent
        if parent.name == "checkpoints" and is_run_dir(parent.parent):
            return "the checkpoints of the run", parent.parent
        if is_data_dir(parent):
            return "the data dir", parent
    return None


def _held_within(tree: Path, kind: str) -> tuple[str, Path] | None:
    """A run dir, checkpoint or data dir (other than `tree` itself, for a data dir) in `tree`, links not
    followed: (what, where), or None."""
    for root, dirs, _ in os.walk(tree, followlinks=False):
        here = Path(root)
        if is_run_dir(here):
            return "the run dir", here
        if is_checkpoint_dir(here):
            return "the checkpoint", here
        if is_data_dir(here) and not (here == tree and kind == "data"):
            return "the data dir", here
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]
    return None


def check_replaceable(out: Path, kind: str, keep=()) -> None:
    """Before a writer creates or replaces `out` as a `kind` output (see OUTPUTS): UserError, one line
    naming the path and the fix, unless the module's rule allows it. Called before any work, and again
    by atomic_directory and remove_output just before anything is replaced."""
    out = Path(out)
    what = OUTPUTS[kind]
    if out.is_symlink():
        raise UserError(
            f"{out}: is a symbolic link (to {os.readlink(out)}); pretrainer never writes through a link; "
            f"give the real path as --out"
        )
    target = Path(os.path.abspath(out)).parent.resolve() / out.name
    held = [Path(path).resolve() for path in [*keep, Path.cwd()]]
    if target in held:
        raise UserError(f"{out}: is {target} itself, which this command uses; choose another --out")
    for path in held:
        if target in path.parents:
            raise UserError(f"{out}: would replace {path}, which it holds; choose another --out")
    inside = _held_inside(target)
    staging_beside_source = kind == "hub-push" and inside is not None and inside[1] == target.parent
    if inside is not None and not staging_beside_source:
        raise UserError(
            f"{out}: is inside {inside[0]} {inside[1]}, which only its writer changes; choose another --out"
        )
    if not out.exists():
        return
    if not owned(out, kind):
        raise UserError(
            f"{out}: exists and is not {what} pretrainer wrote (no {MARKER_NAMES[kind in FILE_OUTPUTS]}), so "
            f"it is not replaced; choose another --out, or remove it yourself"
        )
    if out.is_dir() and (within := _held_within(target, kind)) is not None:
        raise UserError(
            f"{out}: holds {within[0]} {within[1]}, so it is never replaced; move that out first or choose "
            f"another --out"
        )


def remove_output(path: Path, kind: str) -> None:
    """Remove a `kind` output (an interrupted push's staging) if the rule allows it; else UserError."""
    check_replaceable(path, kind)
    if Path(path).is_dir():
        shutil.rmtree(path)
    else:
        Path(path).unlink(missing_ok=True)
