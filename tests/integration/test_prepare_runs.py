import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from helpers import DOCS, run_subprocess


def test_hf_source_reads_the_hub_cache_offline(tmp_path: Path):
    # A local directory laid out like the Hugging Face hub cache; HF_HUB_OFFLINE=1 makes
    # snapshot_download resolve refs/main from it instead of the network.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--someorg--somedata"
    shard_dir = repo / "snapshots" / commit / "sample" / "10BT"
    shard_dir.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    pq.write_table(pa.table({"text": DOCS[:100]}), shard_dir / "000_00000.parquet")
    pq.write_table(
        pa.table({"text": ["not matched by the glob"]}), repo / "snapshots" / commit / "other.parquet"
    )
    out = tmp_path / "data"
    result = run_subprocess(
        "prepare",
        "--corpus",
        "hf:someorg/somedata:sample/10BT/*.parquet",
        "--tokenizer",
        "bpe:300",
        "--val-fraction",
        "0.2",
        "--out",
        out,
        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 100
    # provenance: the snapshot revision and the files read; offline, a warning that only the cache was seen
    hub = manifest["sources"][0]["hub"]
    assert (
        hub["revision"] == commit
        and hub["files"] == ["sample/10BT/000_00000.parquet"]
        and hub["offline"] is True
    )
    assert (
        "offline (HF_HUB_OFFLINE): used the 1 cached files of someorg/somedata@0123456789ab" in result.stdout
    )
    assert manifest["sources"][0]["files"][0]["documents"] == 100
