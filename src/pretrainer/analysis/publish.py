"""`pretrainer push PATH REPO_ID`: a prepared data dir, or a run as a Hugging Face export, to the Hub.

    pretrainer push data/fw-gpt2 me/fw-gpt2          # a dataset repo: token files, manifest, tokenizer
    pretrainer push runs/x1 me/x1-50m                 # a model repo: the newest checkpoint, exported
    pretrainer push runs/x1 me/x1-50m --dry-run       # stage and show, upload nothing

What goes up is staged first in PATH/.hub-push/: the files (hard links where the file system allows),
a card (README.md: for data, what was prepared from what; for a run, its config, data, losses, evals,
and plan against actual) and checksums.sha256 of every file, which `pull` (data/hub.py) verifies. The
upload is huggingface_hub's (no git, no git-lfs): with hf_xet, chunked and resumed by running the same
command again; without, `upload_large_folder` where the installed version has it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.keys import config_text
from pretrainer.config.resolve import uses_qk_norm
from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes
from pretrainer.core.ownership import OUTPUT_MARKER, mark_output, remove_output
from pretrainer.data.hub import CHECKSUMS, hidden, link_outside, parse_hub_spec, write_checksums

STAGING = ".hub-push"


UPLOAD_IGNORE = [OUTPUT_MARKER]  # staged, never uploaded: the staging's own marker


def push(
    path: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    dtype: str = "bf16",
    say=print,
) -> Path:
    """Stage PATH (a data dir or a run dir) and upload it as REPO_ID. -> the staged directory."""
    path = Path(path)
    repo_id, given_revision = parse_hub_spec(repo_id)
    revision = revision or given_revision
    if (path / "manifest.json").is_file() and '"splits"' in (path / "manifest.json").read_text():
        repo_type, staged = "dataset", stage_data_dir(path, repo_id)
    elif (path / "checkpoints").is_dir() or (path / "state.json").is_file():
        repo_type, staged = "model", stage_run(path, repo_id, dtype)
    else:
        raise UserError(
            f"{path}: neither a prepared data dir (manifest.json, from `pretrainer prepare`) nor a run dir "
            f"(checkpoints/); push takes one of those"
        )
    files = sorted(p for p in staged.rglob("*") if p.is_file() and not hidden(p, staged))  # as uploaded
    size = sum(p.stat().st_size for p in files)
    say(
        f"staged {len(files)} files ({size / 1e6:,.1f} MB) of a {repo_type} in {staged}, with README.md and "
        f"{CHECKSUMS}"
    )
    if dry_run:
        say(
            f"dry run: nothing uploaded; without --dry-run they go to https://huggingface.co/"
            f"{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
        )
        return staged
    upload(staged, repo_id, repo_type, private, revision)
    pull_hint = f"--data.dir=hf://{repo_id}" if repo_type == "dataset" else f"--init.from=hf://{repo_id}"
    say(f"pushed to {repo_id} ({repo_type}); use it with {pull_hint}")
    return staged


def _fresh_staging(path: Path) -> Path:
    staged = path / STAGING
    if staged.exists() or staged.is_symlink():
        remove_output(staged, "hub-push")  # a push that was interrupted: staged again from the source
    staged.mkdir()
    mark_output(staged, "hub-push")
    return staged


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)  # token files are large and never change: no second copy
    except OSError:
        shutil.copy2(source, target)


def stage_data_dir(data_dir: Path, repo_id: str) -> Path:
    from pretrainer.data.data_dir import open_data_dir

    open_data_dir(data_dir)  # a complete, consistent prepared dir, or one line saying why not
    outside = link_outside(data_dir, data_dir)
    if outside is not None:
        raise UserError(
            f"{data_dir}: {outside[0]} links outside the data dir (to {outside[1]}); push uploads only the "
            f"data dir's own files: copy it in or remove the link"
        )
    staged = _fresh_staging(data_dir)
    for source in sorted(p for p in data_dir.rglob("*") if p.is_file()):
        relative = source.relative_to(data_dir)
        if not hidden(source, data_dir) and relative.name not in ("README.md", CHECKSUMS):
            _link_or_copy(source, staged / relative)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    atomic_write_bytes(staged / "README.md", dataset_card(manifest, repo_id).encode())
    write_checksums(staged)
    return staged


def shard_names(info: dict) -> str:
    """A split's token files for the card: `train.bin`, or `train-00000.bin` .. `train-00011.bin` (12)."""
    names = [f"`{shard['file']}`" for shard in info.get("shards", [info])]
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def dataset_card(manifest: dict, repo_id: str) -> str:
    splits, tokenizer = manifest["splits"], manifest["tokenizer"]
    rows = "\n".join(
        f"| {name} | {info.get('documents', 0):,} | {info.get('tokens', 0):,} | {shard_names(info)} | "
        f"`{info['sha256'][:16]}...` |"
        for name, info in splits.items()
    )
    sources = "\n".join(
        f"- `{source.get('spec', '?')}`: {source.get('documents', 0):,} documents, "
        f"{source.get('bytes', 0):,} bytes"
        + (f" (hub {source['hub']['repo']}@{source['hub']['revision'][:12]})" if source.get("hub") else "")
        for source in manifest.get("sources", [])
    )
    return f"""---
tags:
- pretrainer
- tokenized
---
# {repo_id}

Token files prepared by pretrainer {manifest.get("pretrainer_version", "")}: the
tokenizer `{tokenizer["name"]}` (vocabulary {tokenizer["vocab_size"]:,}), tokens stored as
`{manifest["dtype"]}`, split into train and validation by {manifest.get("split_by", "document")}
(seed {manifest.get("seed")}).

| split | documents | tokens | file | sha256 |
| --- | --- | --- | --- | --- |
{rows}

Sources:
{sources or "- (not recorded)"}

Prepared with: `{manifest.get("command", "")}`

## Use

```
pretrainer prepare --from-hub {repo_id} --out data/{repo_id.split("/")[1]}   # pull and verify every file
pretrainer train CONFIG --data.dir=hf://{repo_id}                        # or pull at launch
```

`{CHECKSUMS}` lists every file's sha256 (`sha256sum -c {CHECKSUMS}` checks it by hand); a pull checks each
file against it, and training checks the token files against `manifest.json`.
"""


def stage_run(run_dir: Path, repo_id: str, dtype: str) -> Path:
    from pretrainer.artifacts.hf_format import export_hf
    from pretrainer.artifacts.runs import open_run

    run = open_run(run_dir)  # a run dir or one of its checkpoints: staged beside the run, not inside it
    staged = run.run_dir / STAGING  # export_hf replaces it whole
    export_hf(run.cfg.model, run.load_weights(), run.tokenizer(), staged, dtype, kind="hub-push")
    atomic_write_bytes(staged / "README.md", model_card(run, repo_id, dtype).encode())
    write_checksums(staged)
    return staged


def model_card(run, repo_id: str, dtype: str) -> str:
    records = read_metrics(run.run_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    m, dataset = run.cfg.model, run.state.get("dataset") or {}
    results = [("final train loss", f"{train[-1]['loss']:.4f}" if train else "")]
    if val:
        results += [("final validation loss", f"{val[-1]['val_loss']:.4f}")]
        if val[-1].get("val_bpb") is not None:
            results += [("bits per byte (validation)", f"{val[-1]['val_bpb']:.4f}")]
    for path in sorted(run.run_dir.glob("eval-*.json")):
        scores = json.loads(path.read_text())
        for name, value in scores.items():
            if isinstance(value, float):
                results.append((f"{path.stem}: {name}", f"{value:.4f}"))
    table = lambda rows: "\n".join("| " + " | ".join(row) + " |" for row in rows)
    from pretrainer.analysis.report.html import plan_against_actual

    plan_rows = plan_against_actual(run)
    tokenizer = dataset.get("tokenizer", {})
    qk_norm = " with QK-norm (in transformers: Qwen3)" if m.arch == "llama" and uses_qk_norm(m) else ""
    return f"""---
library_name: transformers
tags:
- pretrainer
- from-scratch
---
# {repo_id}

A {m.arch}-style decoder{qk_norm} ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads,
context {m.seq_len}) pretrained from scratch with pretrainer: checkpoint `{run.checkpoint.name}`,
weights in {dtype}.

## Data

Tokenizer `{tokenizer.get("name", "?")}` (vocabulary {tokenizer.get("vocab_size", m.vocab_size):,});
{run.state["tokens"]:,} tokens seen over {run.state["step"]:,} steps. Data provenance (each split's sha256):

```json
{json.dumps(dataset.get("splits", {}), indent=1)[:3000]}
```

## Results

| figure | value |
| --- | --- |
{table(results)}

## Plan against actual

| figure | planned | actual |
| --- | --- | --- |
{table(plan_rows)}

## Config

```toml
{config_text(run.cfg)}```

`{CHECKSUMS}` lists every file's sha256; `pretrainer` verifies them on `--init.from=hf://{repo_id}`.
"""


def upload(staged: Path, repo_id: str, repo_type: str, private: bool, revision: str | None) -> None:
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id, repo_type=repo_type).private:  # exist_ok left it public
            raise UserError(f"push {repo_id}: --private, but the repo exists and is public; nothing uploaded")
        if revision:
            api.create_branch(repo_id, repo_type=repo_type, branch=revision, exist_ok=True)
        large = getattr(api, "upload_large_folder", None)  # huggingface_hub < 1.0: its resumable upload
        if large is not None:
            large(
                repo_id=repo_id,
                folder_path=str(staged),
                repo_type=repo_type,
                revision=revision,
                ignore_patterns=UPLOAD_IGNORE,
            )
        else:  # with hf_xet: chunked, several commits for a large folder, resumed by running it again
            api.upload_folder(
                repo_id=repo_id,
                folder_path=str(staged),
                repo_type=repo_type,
                revision=revision,
                commit_message="pretrainer push",
                ignore_patterns=UPLOAD_IGNORE,
                delete_patterns="*",  # the repo mirrors what was staged: no stale file an earlier push left
            )
    except UserError:
        raise
    except Exception as e:  # auth, network, quota: one line; the staged files stay for the next try
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(
            f"push {repo_id}: the upload failed ({type(e).__name__}: {first}); `hf auth login` (or HF_TOKEN) "
            f"for write access, then run the same command again: it resumes"
        ) from None
