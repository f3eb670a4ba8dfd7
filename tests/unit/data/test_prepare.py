import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import DOCS, split_documents
from tqdm import tqdm

from pretrainer.core.ownership import OUTPUT_MARKER
from pretrainer.data.data_dir import open_data_dir
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus
from pretrainer.data.token_files import token_dtype
from pretrainer.data.tokenizers.base import METADATA_FILE
from pretrainer.data.tokenizers.load import load_tokenizer


def test_manifest_counts_and_hashes_match_the_files(stdlib_data: Path):
    manifest = json.loads((stdlib_data / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 1024 and manifest["dtype"] == "uint16"
    assert manifest["sources"][0]["spec"] == "stdlib"
    for split in ("train", "val"):
        info = manifest["splits"][split]
        shards = [(stdlib_data / shard["file"]).read_bytes() for shard in info["shards"]]
        for shard, data in zip(info["shards"], shards):
            assert len(data) == shard["tokens"] * 2 and hashlib.sha256(data).hexdigest() == shard["sha256"]
        data = b"".join(shards)  # the split's stream
        assert len(data) == info["tokens"] * 2
        assert hashlib.sha256(data).hexdigest() == info["sha256"]
        assert (
            np.count_nonzero(np.frombuffer(data, dtype=np.uint16) == manifest["tokenizer"]["eot_id"])
            == info["documents"]
        )
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 400
    assert load_tokenizer(stdlib_data).sha256 == manifest["tokenizer"]["sha256"]


def test_documents_are_whole_and_val_is_disjoint_from_train(jsonl_corpus: Path, tmp_path: Path):
    out = tmp_path / "data"
    prepare(Corpus([str(jsonl_corpus)]), "bpe:300", out, val_fraction=0.2, seed=3, workers=1)
    train, val = split_documents(out, "train"), split_documents(out, "val")
    assert len(val) > 10 and len(train) > 100
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(DOCS)  # every document exactly once, byte for byte
    assert [d for d in DOCS if d in set(train)] == train  # corpus order is kept within a split


def test_data_dirs_from_before_the_hugging_face_tokenizer_files_still_open(
    jsonl_corpus: Path, tmp_path: Path
):
    out = tmp_path / "data"
    prepare(Corpus([str(jsonl_corpus)]), "bpe:300", out, val_fraction=0.2, seed=3, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    shards = {shard["file"] for split in manifest["splits"].values() for shard in split["shards"]}
    written = {p.name for p in out.iterdir()} - shards - {"manifest.json", OUTPUT_MARKER}
    assert set(manifest["tokenizer"]["files"]) == written >= {"tokenizer.json", "tokenizer_config.json"}
    # The old layout: our metadata as tokenizer.json, no Hugging Face files, the old file list.
    (out / "tokenizer_config.json").unlink()
    os.replace(out / METADATA_FILE, out / "tokenizer.json")
    manifest["tokenizer"]["files"] = ["tokenizer.json", "tokenizer.tiktoken"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert open_data_dir(out).tokenizer.sha256 == manifest["tokenizer"]["sha256"]


def test_split_is_deterministic_and_independent_of_workers(jsonl_corpus: Path, tmp_path: Path):
    manifests = []
    for name, workers in (("a", 1), ("b", 2)):
        prepare(
            Corpus([str(jsonl_corpus)]), "bpe:300", tmp_path / name, val_fraction=0.2, seed=3, workers=workers
        )
        manifests.append(json.loads((tmp_path / name / "manifest.json").read_text()))
    assert manifests[0]["splits"] == manifests[1]["splits"]
    prepare(Corpus([str(jsonl_corpus)]), "bpe:300", tmp_path / "c", val_fraction=0.2, seed=4, workers=1)
    other = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert other["splits"]["val"]["sha256"] != manifests[0]["splits"]["val"]["sha256"]


def test_text_parquet_directory_and_glob_sources(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.txt").write_text("first document\nstill first\n")
    (src / "many.txt").write_text("doc a line 1\ndoc a line 2\n\n\ndoc b\n\ndoc c\n")
    pq.write_table(
        pa.table({"text": ["parquet doc 1", "parquet doc 2", None], "id": [1, 2, 3]}), src / "shard.parquet"
    )
    docs = list(Corpus([str(src)], txt_docs="blank-lines").documents())
    assert docs == [
        "doc a line 1\ndoc a line 2",
        "doc b",
        "doc c",
        "first document\nstill first",
        "parquet doc 1",
        "parquet doc 2",
    ]
    assert list(Corpus([str(src / "*.txt")]).documents()) == [
        (src / "many.txt").read_text(),
        (src / "one.txt").read_text(),
    ]


def test_progress_bar_ends_at_the_corpus_size(jsonl_corpus: Path, tmp_path: Path, monkeypatch):
    """Progress counts file bytes, like its total: JSON syntax, skipped lines and parquet compression
    included."""
    bars = []

    class RecordedBar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(importlib.import_module("pretrainer.data.work_dir"), "tqdm", RecordedBar)
    with open(jsonl_corpus, "a") as f:  # a blank line, a null text and a duplicate: read, but not tokenized
        f.write('\n{"text": null}\n' + json.dumps({"text": DOCS[0]}) + "\n")
    pq.write_table(pa.table({"text": DOCS[:50]}), tmp_path / "shard.parquet")
    (tmp_path / "notes.txt").write_text("one\n\n\ntwo\n")
    corpus = Corpus(
        [str(jsonl_corpus), str(tmp_path / "shard.parquet"), str(tmp_path / "notes.txt")],
        txt_docs="blank-lines",
    )
    prepare(corpus, "bpe:300", tmp_path / "data", val_fraction=0.2, seed=3, workers=1)
    (bar,) = bars
    assert bar.total == corpus.total_bytes and bar.n == bar.total


def test_token_dtype_widens_past_65536():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_out_dir_is_refused_if_present_and_replaced_with_force(jsonl_corpus: Path, tmp_path: Path, run_cli):
    out = tmp_path / "data"
    args = (
        "prepare",
        "--corpus",
        jsonl_corpus,
        "--tokenizer",
        "bpe:300",
        "--val-fraction",
        "0.2",
        "--out",
        out,
        "--workers",
        "1",
    )
    assert run_cli(*args)[0] == 0
    code, _, err = run_cli(*args)
    assert code == 2 and "already exists" in err
    assert run_cli(*args, "--force")[0] == 0 and (out / "manifest.json").is_file()


# --- bad input: one clear line naming the file, exit code 2, no output dir left behind ---


def _bad_jsonl(tmp: Path) -> Path:
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine too"}\nnot json at all\n')
    return tmp / "bad.jsonl"


def _no_text_jsonl(tmp: Path) -> Path:
    (tmp / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    return tmp / "notext.jsonl"


def _no_text_parquet(tmp: Path) -> Path:
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp / "notext.parquet")
    return tmp / "notext.parquet"


def _empty(tmp: Path) -> Path:
    (tmp / "empty.txt").write_text("  \n\n")
    return tmp / "empty.txt"


def _latin1(tmp: Path) -> Path:
    (tmp / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    return tmp / "latin1.txt"


@pytest.mark.parametrize(
    "make_corpus, extra, message",
    [
        (_empty, [], r"empty corpus"),
        (_bad_jsonl, [], r"bad\.jsonl:3: not valid JSON"),
        (_no_text_jsonl, [], r"notext\.jsonl:2: no 'text' field"),
        (_no_text_parquet, [], r"notext\.parquet: parquet file has no 'text' column \(columns: content\)"),
        (_latin1, ["--utf8-errors", "strict"], r"latin1\.txt: invalid UTF-8 at byte 3"),
    ],
)
def test_bad_corpus_gives_one_line_and_no_output(tmp_path: Path, run_cli, make_corpus, extra, message):
    import re

    corpus = make_corpus(tmp_path)
    out = tmp_path / "out"
    code, _, err = run_cli(
        "prepare", "--corpus", corpus, "--tokenizer", "bpe:300", "--out", out, "--workers", "1", *extra
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_invalid_utf8_is_replaced_and_counted_by_default(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    _latin1(tmp_path / "docs")
    (tmp_path / "docs" / "ok.txt").write_text("plain ascii document\n")
    out = tmp_path / "out"
    # seed 19 splits the two
    prepare(Corpus([str(tmp_path / "docs")]), "bpe:260", out, val_fraction=0.5, seed=19, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    # (by content: see is_val_document)
    assert manifest["utf8"] == {"errors": "replace", "replaced_documents": 1}
    texts = split_documents(out, "train") + split_documents(out, "val")
    assert "caf\ufffd cr\ufffdme\n" in texts
