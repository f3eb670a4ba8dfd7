"""prepare at scale (data/work_units.py, data/shards.py): units that workers read themselves, shards, the
same bytes for any number of workers or parts, a prepare killed anywhere that continues, and the loader's
view of shards as one stream."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import DOCS, fork_cli

from pretrainer.core.errors import UserError
from pretrainer.data.data_dir import open_data_dir
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus
from pretrainer.data.token_files import ShardedTokens, byte_ranges
from pretrainer.data.work_units import Span, plan_units

UNIT = 4096  # bytes of input per unit here (MIN_UNIT_BYTES, lowered): many units from a small corpus


@pytest.fixture
def small_units(monkeypatch):
    monkeypatch.setattr("pretrainer.data.work_units.MIN_UNIT_BYTES", UNIT)


def docs(n: int, tag: str) -> list[str]:
    return [f"# {tag} {i}\n{DOCS[i % len(DOCS)]}" for i in range(n)]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """Every kind of unit: a JSONL file cut in byte ranges, a parquet file's row groups, whole .txt files;
    exact duplicates inside a file, across files, and so across units and parts."""
    root = tmp_path_factory.mktemp("corpus")
    a = docs(300, "a")
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in a + a[:20]))
    table = pa.table({"text": docs(200, "b") + a[100:130]})
    pq.write_table(table, root / "b.parquet", row_group_size=25)
    for i in range(6):
        (root / f"c{i}.txt").write_text(docs(1, f"c{i}")[0] * 40)
    (root / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(150, "d")))
    with gzip.open(root / "e.jsonl.gz", "wt") as f:  # larger than a unit, compressed: never cut
        noise = [hashlib.sha256(str(i).encode()).hexdigest() * 3 for i in range(400)]  # not compressible
        f.write(
            "".join(
                json.dumps({"text": t}) + "\n"
                for t in [*map(" ".join, zip(docs(400, "e"), noise)), *a[200:210]]
            )
        )
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small BPE's data dir (its tokenizer saves in milliseconds, GPT-2's in a second)."""
    out = tmp_path_factory.mktemp("bpe") / "data"
    (out.parent / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    prepare(Corpus([str(out.parent / "docs.jsonl")]), "bpe:300", out, val_fraction=0.1, workers=1)
    return out


@pytest.fixture
def run_prepare(tokenizer_dir):
    def run(corpus: Path, out: Path, **options) -> dict | None:
        settings = {
            "val_fraction": 0.1,
            "seed": 1,
            "shard_tokens": 5000,
            "tokenizer_from": str(tokenizer_dir),
        }
        return prepare(Corpus([str(corpus)]), "gpt2", out, **{**settings, **options})

    return run


def files_of(out: Path) -> dict[str, bytes]:
    """Every file of a data dir but the manifest's times, version and command, which say when and how."""
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("created_utc", "command"):
        manifest.pop(key)
    files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


def test_units_are_cut_from_the_files_alone(corpus_dir, small_units):
    corpus = Corpus([str(corpus_dir)])
    units = plan_units(corpus)
    kinds = {corpus.files[span.file].kind for unit in units for span in unit.spans}
    assert len(units) > 8 and kinds == {"jsonl", "parquet", "txt"}
    compressed = [s for u in units for s in u.spans if corpus.files[s.file].path.name == "e.jsonl.gz"]
    assert compressed == [Span(compressed[0].file)] and corpus.files[-1].path.stat().st_size > UNIT
    assert sum(unit.bytes for unit in units) == corpus.total_bytes
    ranged = [span for unit in units for span in unit.spans if corpus.files[span.file].path.name == "a.jsonl"]
    assert len(ranged) > 2 and ranged[0].start == 0 and ranged[-1].end == -1
    assert all(x.end == y.start for x, y in zip(ranged, ranged[1:]))  # contiguous, no byte twice
    # every document read once, in order, whatever the cut
    whole = list(corpus.documents())
    assert [
        d for unit in units for s in unit.spans for d in corpus.read_span(s.file, s.start, s.end)
    ] == whole


def test_one_two_three_workers_and_three_parts_write_the_same_bytes(
    corpus_dir, small_units, run_prepare, tmp_path
):
    reference = run_prepare(corpus_dir, tmp_path / "w1", workers=1)
    assert reference["duplicate_documents"] == 60  # 20 inside a.jsonl, 40 across files (parquet, gzip)
    assert len(reference["splits"]["train"]["shards"]) > 3
    expected = files_of(tmp_path / "w1")
    for workers in (2, 3):
        run_prepare(corpus_dir, tmp_path / f"w{workers}", workers=workers)
        assert files_of(tmp_path / f"w{workers}") == expected, workers
    out = tmp_path / "parts"
    for part in ("2/3", "3/3", "1/3"):  # in any order, as array tasks finish
        assert run_prepare(corpus_dir, out, workers=1, part=part) is None and not out.exists()
    with pytest.raises(UserError, match="--part tokenizes one slice"):
        run_prepare(corpus_dir, out, part="1/3", merge=True)
    run_prepare(corpus_dir, out, merge=True)
    assert files_of(out) == expected
    assert not (tmp_path / "parts.prepare").exists()  # the work dir goes once OUT is complete
    # one shard per split: the same streams, the same split checksums
    single = run_prepare(corpus_dir, tmp_path / "one", workers=1, shard_tokens=1 << 30)
    for split in ("train", "val"):
        assert single["splits"][split]["sha256"] == reference["splits"][split]["sha256"]
        tokens = open_data_dir(tmp_path / "w1").tokens(split)
        assert isinstance(tokens, ShardedTokens) or split == "val"  # val fits one shard
        assert np.array_equal(tokens[:], np.fromfile(tmp_path / "one" / f"{split}-00000.bin", np.uint16))


def test_merge_before_every_part_is_done_says_what_is_missing(corpus_dir, small_units, run_prepare, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"out\.prepare: not found; run every --part I/N"):
        run_prepare(corpus_dir, out, merge=True)
    run_prepare(corpus_dir, out, workers=1, part="1/2")
    done = sorted(p.name for p in (tmp_path / "out.prepare" / "units").iterdir())
    with pytest.raises(UserError, match=r"units are not tokenized yet; run every --part I/N first"):
        run_prepare(corpus_dir, out, merge=True)
    assert sorted(p.name for p in (tmp_path / "out.prepare" / "units").iterdir()) == done  # kept as it was
    with pytest.raises(UserError, match=r"--part 3/2: give I/N"):
        run_prepare(corpus_dir, out, part="3/2")


def test_a_prepare_killed_anywhere_continues_to_the_same_bytes(
    corpus_dir, small_units, run_prepare, tokenizer_dir, tmp_path, capsys
):
    """SIGKILL at a random point (before any unit, between units, while joining; with 2 workers, whose
    processes end with it), then the same command: the files of an uninterrupted prepare, the units done
    before kept (and said so)."""
    run_prepare(corpus_dir, tmp_path / "straight", workers=1)
    expected = files_of(tmp_path / "straight")
    units = len(plan_units(Corpus([str(corpus_dir)])))
    draw = random.Random(os.getpid())
    # (units done when the kill lands, workers)
    for kill_after, workers in (
        (0, 1),
        (draw.randrange(1, units), 1),
        (units, 1),
        (draw.randrange(1, units), 2),
    ):
        out = tmp_path / f"killed-{kill_after}-{workers}"
        argv = [
            "prepare",
            "--corpus",
            corpus_dir,
            "--tokenizer-from",
            tokenizer_dir,
            "--out",
            out,
            "--workers",
            workers,
            "--val-fraction",
            "0.1",
            "--seed",
            "1",
            "--shard-tokens",
            "5000",
        ]
        log = tmp_path / f"{out.name}.log"
        child = fork_cli(*argv, log=log)
        units_dir = Path(f"{out}.prepare") / "units"
        deadline = time.time() + 60
        while child.is_alive() and time.time() < deadline:
            if len(list(units_dir.glob("*.json"))) >= kill_after and (kill_after or units_dir.exists()):
                break
            time.sleep(0.002)
        # frozen at once where it is (scanning /proc for its workers takes a while, in which it could join
        # the units into OUT; its workers go on until it is killed), then killed
        with contextlib.suppress(ProcessLookupError):  # it ended first (kill_after == units)
            os.kill(child.pid, signal.SIGSTOP)
        workers_of_child = children(child.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        deadline = time.time() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in workers_of_child) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers_of_child), "an orphaned worker"
        assert not out.exists() or kill_after == units, log.read_text()
        kept = len(list(units_dir.glob("*.json")))
        from pretrainer.cli.main import main

        capsys.readouterr()
        finished = out.exists()  # the kill came after the rename
        code = main([str(a) for a in argv] + (["--force"] if finished else []))
        said = capsys.readouterr().out
        assert code in (0, None)
        assert files_of(out) == expected, kill_after
        if kept and not finished:
            assert f"kept {kept} of {units} units tokenized before" in said, said


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_a_changed_command_is_refused_while_its_units_are_kept(
    corpus_dir, small_units, run_prepare, tmp_path, capsys
):
    out = tmp_path / "out"
    run_prepare(corpus_dir, out, workers=1, part="1/2")
    with pytest.raises(
        UserError, match=r"out\.prepare: holds \d+ units of another prepare .*\(its seed differs\)"
    ):
        run_prepare(corpus_dir, out, workers=1, seed=2)
    capsys.readouterr()
    run_prepare(corpus_dir, out, workers=2)  # the same command, more workers: it continues
    assert "kept" in capsys.readouterr().out
    run_prepare(corpus_dir, tmp_path / "straight", workers=1)
    assert files_of(out) == files_of(tmp_path / "straight")
    run_prepare(corpus_dir, tmp_path / "other", workers=1, part="1/2")
    run_prepare(corpus_dir, tmp_path / "other", workers=1, seed=2, force=True)  # --force: starts over
    assert json.loads((tmp_path / "other" / "manifest.json").read_text())["seed"] == 2


def test_sharded_tokens_read_as_their_concatenation(tmp_path):
    whole = np.arange(1000, dtype=np.uint16)
    bounds = [0, 300, 301, 700, 1000]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        whole[a:b].tofile(tmp_path / f"s{i}.bin")
    shards = ShardedTokens([np.memmap(tmp_path / f"s{i}.bin", dtype=np.uint16, mode="r") for i in range(4)])
    assert len(shards) == 1000
    for a, b in [(0, 1000), (299, 302), (300, 301), (5, 5), (650, 900), (999, 1000), (990, 2000)]:
        assert np.array_equal(shards[a:b], whole[a:b]), (a, b)
    spans = list(byte_ranges(shards, 299, 302))
    assert [(Path(f).name, offset, count) for f, offset, count in spans] == [
        ("s0.bin", 598, 2),
        ("s1.bin", 0, 2),
        ("s2.bin", 0, 2),
    ]


@pytest.mark.parametrize("packing", ["concat", "document", "pad"])
def test_the_loader_reads_shards_as_it_reads_one_file(tmp_path, packing):
    from pretrainer.data.loader import TokenSource

    draw = np.random.default_rng(0)
    whole = draw.integers(1, 50, 5000).astype(np.uint16)
    whole[draw.choice(5000, 300, replace=False)] = 0  # document ends, some at shard boundaries
    whole[-1] = 0
    whole.tofile(tmp_path / "whole.bin")
    cuts = [0, 700, 701, 2048, 4999, 5000]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        whole[a:b].tofile(tmp_path / f"s{i}.bin")
    shards = [np.memmap(tmp_path / f"s{i}.bin", dtype=np.uint16, mode="r") for i in range(len(cuts) - 1)]
    one = TokenSource(
        np.memmap(tmp_path / "whole.bin", dtype=np.uint16, mode="r"), 64, packing=packing, eot_id=0
    )
    many = TokenSource(ShardedTokens(shards), 64, packing=packing, eot_id=0)
    assert many.n_sequences == one.n_sequences > 50
    ids = list(range(one.n_sequences))
    many.warm(ids)  # reads each window's bytes from its shards
    for a, b in zip(one.windows(ids), many.windows(ids)):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_a_bad_line_in_a_byte_range_is_named_by_its_line_in_the_file(small_units, run_prepare, tmp_path):
    lines = [json.dumps({"text": t}) for t in docs(400, "x")]
    lines[333] = '{"text": broken'
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.jsonl").write_text("\n".join(lines) + "\n")
    corpus = Corpus([str(tmp_path / "c")])
    ranges = [s for u in plan_units(corpus) for s in u.spans]
    assert len(ranges) > 3 and all(s.start % 2 == 0 for s in ranges)  # cut mid-line, not at line starts
    with pytest.raises(UserError, match=r"x\.jsonl:334: not valid JSON"):
        run_prepare(tmp_path / "c", tmp_path / "out", workers=1)
    lines[333], lines[3] = lines[334], '{"text": broken'
    (tmp_path / "c" / "x.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"x\.jsonl:4: not valid JSON"):
        run_prepare(tmp_path / "c", tmp_path / "new", workers=1)
    assert not (tmp_path / "new.prepare").exists()  # made by this prepare, no unit done: no trace
