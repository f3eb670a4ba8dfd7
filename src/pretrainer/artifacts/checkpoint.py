"""Atomic checkpoints: RUN_DIR/checkpoints/step-NNNNNNN/{model.safetensors, optimizer.pt, state.json,
COMPLETE}.

Written into a temp directory, every file fsynced, the COMPLETE marker written last, then renamed
into place: a directory without COMPLETE (a crash mid-write) is never resumed from. The newest
`keep` complete checkpoints are kept. COMPLETE records each file's size and sha256; resume verifies
them and falls back past a damaged checkpoint (torn, truncated, bit-flipped, missing) to the newest
intact one, with a one-line warning. Nothing trains from damaged state.

Weights are safetensors (no pickle). The optimizer state holds only tensors and plain values and
is loaded with torch.load(weights_only=True). state.json carries the step, tokens, data position,
RNG states and the config.

In a run, `write_checkpoint` (a collective: every rank gathers its shards, rank 0 writes) and
`restore_checkpoint` (rank 0 reads, every rank receives its part) are what the loop calls;
`read_resume_checkpoint` picks and reads where a run starts from, on rank 0 only: no other rank
ever holds the full weights and optimizer state in host memory.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from pretrainer.core.device import tensor_bytes
from pretrainer.core.errors import NotThisRun, UserError, WriteFault, write_fault
from pretrainer.core.files import (
    atomic_directory,
    atomic_write_json,
    nearest_existing,
    sha256_file,
    write_hashed,
)
from pretrainer.optim.state_file import state_for_file, state_from_file

CHECKPOINT_NAME = re.compile(r"^step-(\d{7,})$")
MARKER = "COMPLETE"
FILES = ("model.safetensors", "optimizer.pt", "state.json")


class DamagedCheckpoint(UserError):
    pass


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_step(path: Path) -> int:
    return int(CHECKPOINT_NAME.match(Path(path).name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := CHECKPOINT_NAME.match(p.name)) and (p / MARKER).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_val_loss(path: Path) -> float | None:
    """The val loss measured at the checkpoint's own step (state.json "val_loss"), if one was."""
    try:
        value = json.loads((Path(path) / "state.json").read_text()).get("val_loss")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the lowest val loss at its own step (the newer one on a tie)."""
    scored = [(checkpoint_val_loss(c), -checkpoint_step(c), c) for c in list_checkpoints(run_dir)]
    scored = [entry for entry in scored if entry[0] is not None]
    return min(scored)[2] if scored else None


def pick_checkpoint(path: Path, which: str) -> Path:
    """`--checkpoint newest|best` of a run dir: newest -> `path` (a run dir or checkpoint dir, as is);
    best -> the run's lowest-val checkpoint (ckpt.keep_best keeps it), else one line saying why not."""
    if which != "best":
        return Path(path)
    best = best_checkpoint(path) if Path(path).is_dir() else None
    if best is None:
        raise UserError(
            f"{path}: no checkpoint of this run dir has a val loss at its own step; --checkpoint best "
            f"needs a run trained with ckpt.keep_best = true (and eval.every dividing ckpt.every)"
        )
    return best


def model_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's state dict (or a full one gathered across ranks) on CPU, without tied aliases:
    safetensors stores each tensor once."""
    aliases = set(model.tied_aliases())
    state = model.state_dict() if state is None else state
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k not in aliases}


def weights_problem(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str) -> str:
    """ "" when the weights fit the model name by name and shape by shape; else a one-line error."""
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in set(model.tied_aliases())}
    problems = [f"missing {k}" for k in expected if k not in weights]
    problems += [f"unexpected {k}" for k in weights if k not in expected]
    problems += [
        f"{k} {tuple(weights[k].shape)} != {tuple(s)}"
        for k, s in expected.items()
        if k in weights and weights[k].shape != s
    ]
    return (
        f"{where}: weights do not fit this model ({'; '.join(problems[:5])}); check the model.* config"
        if problems
        else ""
    )


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    problem = weights_problem(model, weights, where)
    if problem:
        raise UserError(problem)
    model.load_state_dict(weights, strict=False)


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    trainer_state: dict,
    *,
    keep: int,
    keep_best: bool = False,
) -> Path:
    root = checkpoints_root(run_dir)
    final = root / f"step-{step:07d}"
    needed, free = checkpoint_bytes(weights, optimizer_state), shutil.disk_usage(nearest_existing(root)).free
    if needed > free:  # found before a byte is written, not by a failed write
        raise WriteFault(
            f"{final}: cannot write the checkpoint at step {step}: no space left on the device (it needs "
            f"{needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free); what was saved before is intact; "
            f"free space and run the same command again"
        )
    try:
        _write_checkpoint_dir(final, step, weights, optimizer_state, trainer_state)
    except Exception as e:  # disk full: the temp dir is gone, the older checkpoints stay
        fault = write_fault(e, final, f"the checkpoint at step {step}")
        if fault is None:
            raise
        raise fault from None
    best = best_checkpoint(run_dir) if keep_best else None  # beside the newest `keep`, never rotated away
    for old in list_checkpoints(run_dir)[:-keep]:
        if old != best:
            remove_unless_pinned(old)  # a reader's: the next rotation removes it
    for stale in root.glob(".step-*.tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    return final


_pins: list[int] = []  # this process's pinned checkpoint dirs, held until it exits


def pin_checkpoint(path: Path) -> None:
    """Hold a shared lock on a checkpoint dir for the rest of this process (eval, sample, export,
    serve-cost read it, perhaps more than once), so a trainer's rotation does not remove it mid-read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # gone or not a dir: verifying it says so
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal in progress; then it is gone
    except OSError:  # a filesystem without flock (some network mounts): unpinned
        os.close(fd)
        return
    _pins.append(fd)


def release_pins() -> None:
    """Drop this process's pins (the end of a command: `pretrainer` in-process, as tests run it)."""
    while _pins:
        os.close(_pins.pop())


def remove_unless_pinned(path: Path) -> bool:
    """Remove a checkpoint dir unless a reader holds it (pin_checkpoint); the exclusive lock is held
    through the removal, so no reader pins it halfway. -> whether it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:  # a filesystem without flock: nothing can pin, so remove
        pass
    try:
        shutil.rmtree(path)
    finally:
        os.close(fd)
    return True


def checkpoint_bytes(weights: dict, optimizer_state: dict) -> int:
    """About what a checkpoint takes on disk: its tensors' bytes (the JSON files are small)."""

    def total(value) -> int:
        if isinstance(value, torch.Tensor):
            return tensor_bytes(value)
        if isinstance(value, dict):
            return sum(total(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(total(v) for v in value)
        return 0

    return total(weights) + total(optimizer_state)


def _write_checkpoint_dir(
    final: Path, step: int, weights: dict, optimizer_state: dict, trainer_state: dict
) -> None:
    with atomic_directory(
        final
    ) as tmp:  # replaces the same step saved again (a resumed run stopping where it began)
        # One metadata key only: safetensors writes __metadata__ in hash-map order, so two or more keys
        # can come out in a different order in another process and break byte-identical re-saves.
        # Each file is hashed as it is written (the bytes safetensors.save_file would write).
        files = {
            "model.safetensors": write_hashed(
                tmp / "model.safetensors", lambda f: f.write(safetensors_bytes(weights, {"format": "pt"}))
            ),
            # quantised moments as plain tensors
            "optimizer.pt": write_hashed(
                tmp / "optimizer.pt", lambda f: torch.save(state_for_file(optimizer_state), f)
            ),
        }
        atomic_write_json(tmp / "state.json", trainer_state)
        files["state.json"] = {
            "bytes": (tmp / "state.json").stat().st_size,
            "sha256": sha256_file(tmp / "state.json"),
        }
        atomic_write_json(tmp / MARKER, {"step": step, "files": files})


def read_trainer_state(path: Path) -> dict:
    path = Path(path)
    if not (path / MARKER).is_file():
        raise UserError(
            f"{path}: not a complete checkpoint (no {MARKER} marker); pick another or resume=auto"
        )
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"{path}/state.json: unreadable ({type(e).__name__})") from None


def verify_checkpoint(path: Path, files: tuple[str, ...] = FILES) -> str:
    """ "" when every file is there with the size and sha256 that COMPLETE recorded; else what is
    wrong, in a few words. (Checkpoints written before checksums were recorded: presence only.)"""
    path = Path(path)
    try:
        recorded = json.loads((path / MARKER).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return f"its {MARKER} marker is unreadable"
    for name in files:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if name in recorded:
            size, expected = file.stat().st_size, recorded[name]
            if size != expected["bytes"]:
                return f"{name} has {size:,} bytes but {expected['bytes']:,} were written (torn or truncated)"
            if sha256_file(file) != expected["sha256"]:
                return f"{name} does not match its recorded sha256 (corrupted)"
    return ""


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """-> (model weights, optimizer state, trainer state) from a complete checkpoint directory;
    DamagedCheckpoint (one line) when a file cannot be read."""
    state = read_trainer_state(path)
    try:
        weights = load_file(Path(path) / "model.safetensors")
        optimizer_state = state_from_file(
            torch.load(Path(path) / "optimizer.pt", map_location="cpu", weights_only=True)
        )
    except UserError:  # e.g. 8-bit moments without torchao installed: say so, the checkpoint is fine
        raise
    except Exception as e:  # safetensors, pickle and zip errors have no common base class
        raise DamagedCheckpoint(
            f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None
    return weights, optimizer_state, state


def read_intact(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """load_checkpoint after verify_checkpoint: DamagedCheckpoint saying what is wrong."""
    problem = verify_checkpoint(path)
    if problem:
        raise DamagedCheckpoint(f"{path}: {problem}")
    return load_checkpoint(path)


def resolve_run_or_checkpoint(path: Path) -> Path:
    """A run dir (-> its newest complete checkpoint) or a checkpoint dir (-> itself)."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if not path.exists():
        raise UserError(f"{path}: no such run or checkpoint directory")
    latest = latest_checkpoint(path)
    if latest is None:
        raise UserError(f"{path}: no complete checkpoint found under {checkpoints_root(path)}; train first")
    return latest


def refuse_foreign_checkpoint(run_dir: Path, checkpoint: Path) -> None:
    """A checkpoint of another run may start a new run dir (a branch: that run continued elsewhere), never
    continue into a run dir that holds checkpoints of its own, which it would rotate away and whose
    config and metrics it would rewrite. The run's own checkpoints are in its checkpoints/ dir (a
    symlink there counts), or elsewhere with the config the run has now (a backup copy)."""
    if not list_checkpoints(run_dir):  # a new run dir, or a branch that died before its first checkpoint
        return
    if checkpoint.absolute().parent.resolve() == checkpoints_root(run_dir).resolve():
        return
    if _same_config(run_dir, checkpoint):
        return
    raise NotThisRun(
        f"{run_dir}: holds a run of its own, and train.resume = {checkpoint} belongs to another run; "
        f"to continue that run from there, give a new --run.dir (a branch starts at its step); "
        f"to continue {run_dir}, drop --train.resume"
    )


def _same_config(run_dir: Path, checkpoint: Path) -> bool:
    """The checkpoint's config is the run dir's, compared key by key (a hash would change with every key
    added since they were saved)."""
    from pretrainer.config.keys import diff_keys
    from pretrainer.config.load import from_dict, load_saved_config

    try:
        state = json.loads((checkpoint / "state.json").read_text())
        ours = load_saved_config(run_dir / "config.toml")
        return not diff_keys(from_dict(state["config"], f"{checkpoint}/state.json"), ours)
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return False


def read_resume_checkpoint(run_dir: Path, resume: str, say) -> tuple[Path, dict, dict, dict] | None:
    """train.resume -> (checkpoint, weights, optimizer state, trainer state), or None to start fresh.
    "auto": the newest *intact* checkpoint; each damaged one newer than it is reported in one line.
    "never": refuse a run dir that has checkpoints. A path: that checkpoint, which must be intact."""
    if resume == "never":
        if list_checkpoints(run_dir):
            raise UserError(
                f"{run_dir}: has checkpoints but train.resume = 'never'; use a new run.dir or resume=auto"
            )
        return None
    if resume != "auto":
        refuse_foreign_checkpoint(run_dir, Path(resume))
        return (Path(resume), *read_intact(Path(resume)))
    candidates = list_checkpoints(run_dir)
    for path in reversed(candidates):
        try:
            found = (path, *read_intact(path))
        except DamagedCheckpoint as e:
            say(f"warning: damaged checkpoint {e}; falling back to the one before it")
            continue
        retire_after(run_dir, checkpoint_step(path), "damaged")
        return found
    if candidates:
        raise UserError(
            f"{checkpoints_root(run_dir)}: none of the {len(candidates)} checkpoints is intact (see the "
            f"warnings); "
            f"restore one from a backup or start again with a new run.dir"
        )
    return None


def retire_after(run_dir: Path, step: int, why: str) -> None:
    """Checkpoints newer than `step` leave the resume path: "rolled-back" ones (damaged weights of an
    abandoned trajectory) are deleted, "damaged" ones renamed step-N.damaged for inspection."""
    for newer in [c for c in list_checkpoints(run_dir) if checkpoint_step(c) > step]:
        if why == "damaged":
            target = newer.with_name(f"{newer.name}.damaged")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(newer, target)
        else:
            shutil.rmtree(newer)
