"""prepare's work dir, OUT.prepare/: what makes a prepare resumable and shareable by parts.

    OUT.prepare/
      command.json        what the output depends on (command_fingerprint): a rerun continues only if
                          it is equal; another command is refused in one line (--force starts over)
      tokenizer/          the tokenizer, trained or loaded once (a rerun, or another part, reuses it)
      units/              each unit's files and record (data/work_units.py)

open_work_dir makes it whole under a temp name and renames it (parts starting together never see it half
made), discard_work_dir renames it aside before removing it; Work is one job's view (its share of the
units, those done), run_units tokenizes the missing ones over worker processes and hands each record on
in corpus order."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from pretrainer import __version__
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_json
from pretrainer.core.ownership import check_replaceable, mark_output, remove_output
from pretrainer.data.sources import Corpus
from pretrainer.data.token_files import token_dtype
from pretrainer.data.tokenizers.base import METADATA_FILE, RANKS_FILE, Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer
from pretrainer.data.work_units import (
    UnitSettings,
    WorkUnit,
    init_worker,
    plan_units,
    tokenize_unit,
    unique_suffix,
    unit_record,
)


def work_dir_of(out: Path) -> Path:
    return out.with_name(out.name + ".prepare")


def open_work_dir(work: Path, fingerprint: dict, *, force: bool, part: bool) -> bool:
    """Create the work dir, or check that the one there was started by this command. Another command's is
    refused where units would be lost (--force: start over) and always for a part (parts never remove it:
    another part may be using it). -> whether this call created it."""
    for leftover in work.parent.glob(f".{work.name}.old-*"):  # a removal cut short: garbage by name
        shutil.rmtree(leftover, ignore_errors=True)
    recorded = work / "command.json"
    if work.exists() or work.is_symlink():
        check_replaceable(work, "prepare-work")  # ours, not a directory that happens to have the name
        try:
            before = json.loads(recorded.read_text())
        except (OSError, ValueError):
            before = None
        if before == fingerprint:
            return False
        kept = len(list((work / "units").glob("*.json")))
        if part or (kept and not force):  # only work that would be lost is refused
            before = before or {}
            changed = sorted(k for k in {*before, *fingerprint} if before.get(k) != fingerprint.get(k))
            what = (
                "its corpus files changed since"
                if changed == ["files"]
                else f"its {', '.join(changed)} {'differs' if len(changed) == 1 else 'differ'}"
            )
            fix = (
                "remove it, then start every part again"
                if part
                else "run that command again to finish it, or pass --force to start over"
            )
            raise UserError(f"{work}: holds {kept} units of another prepare into this --out ({what}); {fix}")
        discard_work_dir(work)
    # made whole under a temp name, then renamed: parts starting together never see it half made
    staging = work.with_name(f".{work.name}.tmp-{unique_suffix()}")
    try:
        staging.mkdir(parents=True)
        mark_output(staging, "prepare-work")
        atomic_write_json(staging / "command.json", fingerprint)
    except BaseException:  # a full disk: nothing left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, work)
    except OSError:  # another part made it first: it must be this command's
        shutil.rmtree(staging, ignore_errors=True)
        if json.loads(recorded.read_text()) != fingerprint:
            raise UserError(
                f"{work}: another prepare with other arguments started it just now; give every part the "
                f"same command"
            ) from None
        return False
    return True


def discard_work_dir(work: Path) -> None:
    """Remove a work dir: renamed aside first (one process wins the rename; a removal cut short leaves a
    name open_work_dir clears, never a work dir without its marker)."""
    check_replaceable(work, "prepare-work")
    doomed = work.with_name(f".{work.name}.old-{unique_suffix()}")
    try:
        os.rename(work, doomed)
    except FileNotFoundError:  # another process removed it
        return
    remove_output(doomed, "prepare-work")


def command_fingerprint(corpus: Corpus, **settings) -> dict:
    """What a prepare's output depends on: a rerun resumes only if this is equal (not --workers, --part,
    --merge or --force, which change how, not what)."""
    return {
        "pretrainer_version": __version__,
        "files": [
            [str(f.path), f.kind, f.path.stat().st_size, f.path.stat().st_mtime_ns] for f in corpus.files
        ],
        "hub": {spec: hub["revision"] for spec, hub in corpus.hub.items()},
        "txt_docs": corpus.txt_docs,
        "utf8_errors": corpus.utf8_errors,
        "column": corpus.column,
        "on_bad": corpus.on_bad,
        **settings,
    }


def work_tokenizer(work: Path, make) -> Tokenizer:
    """The work dir's tokenizer (trained or loaded once: a rerun, or another part, reuses it), else make()'s,
    saved there first (a part that saves second finds the first's, the same bytes, and uses it)."""
    directory = work / "tokenizer"
    if (directory / METADATA_FILE).is_file() or (directory / RANKS_FILE).is_file():
        return load_tokenizer(directory)
    tokenizer = make()
    staging = work / f"tokenizer.tmp-{unique_suffix()}"
    try:
        tokenizer.save(staging)
    except BaseException:  # a stop signal or a full disk mid-save: no half-written tokenizer left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, directory)
    except OSError:  # another part's is there
        shutil.rmtree(staging, ignore_errors=True)
        other = load_tokenizer(directory)
        if other.sha256 != tokenizer.sha256:
            raise UserError(
                f"{directory}: another part made a different tokenizer from the same command; remove "
                f"{work} and run the parts again"
            )
    return tokenizer


class Work:
    """A prepare's work dir opened: its tokenizer, the corpus's units, this job's share of them (a --part's
    slice, or all) and those already done."""

    def __init__(
        self,
        path: Path,
        corpus: Corpus,
        tokenizer: Tokenizer,
        *,
        part_index: int,
        parts: int,
        seed: int,
        val_fraction: float,
        chat: bool,
    ):
        self.path, self.corpus, self.tokenizer, self.chat = path, corpus, tokenizer, chat
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.units = plan_units(corpus)
        n = len(self.units)
        self.mine = (
            self.units[(part_index - 1) * n // parts : part_index * n // parts] if parts else self.units
        )
        (path / "units").mkdir(exist_ok=True)
        self.done = {u.index: r for u in self.mine if (r := unit_record(path / "units", u.index)) is not None}
        self.settings = UnitSettings(
            corpus, path / "tokenizer", path / "units", seed, val_fraction, chat, self.dtype.name
        )

    def run(self, workers: int, use=lambda record: True, stop_early: bool = False) -> list[dict]:
        """Tokenize this job's units that are not done (run_units)."""
        return run_units(
            self.mine,
            self.done,
            settings=self.settings,
            tokenizer=self.tokenizer,
            workers=workers,
            use=use,
            stop_early=stop_early,
        )


def run_units(
    units: list[WorkUnit],
    done: dict[int, dict],
    *,
    settings: UnitSettings,
    tokenizer: Tokenizer,
    workers: int,
    use,
    stop_early: bool = False,
) -> list[dict]:
    """Tokenize the units not `done` (in `workers` spawned processes; 1: in this one) and hand every unit's
    record to use() in unit order as soon as it and all before it are there; stop when use() returns False
    (stop_early: it may, so look ahead less).
    -> the records used."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    progress = tqdm(
        total=sum(u.bytes for u in units),
        initial=sum(u.bytes for u in units if u.index in done),
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        mininterval=1.0,
        dynamic_ncols=True,
    )
    started, tokens = time.time(), 0
    records, used = dict(done), []
    position = 0  # units[position] is the next to hand to use()

    def hand_over() -> bool:
        nonlocal position, tokens
        while position < len(units) and units[position].index in records:
            record = records[units[position].index]
            position += 1
            used.append(record)
            tokens += record["tokens"]["train"] + record["tokens"]["val"]
            if not use(record):
                return False
        progress.set_postfix_str(f"{tokens / max(time.time() - started, 1e-9):,.0f} tok/s", refresh=False)
        return True

    todo = [u for u in units if u.index not in done]
    try:
        if not hand_over() or not todo:
            return used
        if workers <= 1 or len(todo) == 1:
            for unit in todo:
                records[unit.index] = tokenize_unit(unit, settings, tokenizer)
                progress.update(unit.bytes)
                if not hand_over():
                    return used
            return used
        # spawn, not fork: the parent may hold threads (tqdm, torch) that fork would copy mid-state
        context = multiprocessing.get_context("spawn")
        # units in flight: a few ahead per worker, so none idles while this process joins; with --max-docs
        # one each, as the units past the last document needed are tokenized for nothing
        ahead = workers if stop_early else 2 * workers
        pool = ProcessPoolExecutor(
            min(workers, len(todo)),
            mp_context=context,
            initializer=init_worker,
            initargs=(settings, os.getpid()),
        )
        try:
            queue = iter(todo)
            running = {}
            for unit in queue:
                running[pool.submit(tokenize_unit, unit)] = unit
                if len(running) >= ahead:
                    break
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    unit = running.pop(future)
                    records[unit.index] = future.result()
                    progress.update(unit.bytes)
                if not hand_over():
                    break
                for unit in queue:
                    running[pool.submit(tokenize_unit, unit)] = unit
                    if len(running) >= ahead:
                        break
        except BaseException:  # an error or a signal: the queued units are not started, the running ones
            pool.shutdown(wait=False, cancel_futures=True)  # end with their unit (or their parent)
            raise
        pool.shutdown(wait=True, cancel_futures=True)  # --max-docs had enough: the rest is not started
        return used
    finally:
        progress.close()
