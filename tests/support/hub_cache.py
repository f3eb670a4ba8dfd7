"""What a Hub repo looks like once huggingface_hub has downloaded it: the cache layout that
`snapshot_download` reads offline (HF_HUB_OFFLINE=1), built from a folder `pretrainer push` staged. No
Hub runs here; this stands for the upload and the download between push and pull.

    HF_HUB_CACHE/datasets--ORG--NAME/blobs/<sha256>              the files' bytes
    HF_HUB_CACHE/datasets--ORG--NAME/snapshots/<commit>/<path>   links to those blobs
    HF_HUB_CACHE/datasets--ORG--NAME/refs/main                   the commit main points at
"""

from __future__ import annotations

import hashlib
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

from pretrainer.analysis.publish import UPLOAD_IGNORE


def publish_to_hub_cache(staged: Path, repo_id: str, repo_type: str, cache: Path) -> Path:
    """-> the snapshot directory."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    files = sorted(  # what upload() sends: its ignore patterns left out
        p
        for p in Path(staged).rglob("*")
        if p.is_file() and not any(fnmatch(p.relative_to(staged).as_posix(), ig) for ig in UPLOAD_IGNORE)
    )
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    snapshot = repo / "snapshots" / commit
    for source in files:
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, blob)
        link = snapshot / source.relative_to(staged)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
