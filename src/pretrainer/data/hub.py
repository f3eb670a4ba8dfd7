"""Pulling from the Hugging Face Hub what `pretrainer push` put there (prepared token files, a model
export), verified before use. `hf://ORG/NAME[@REVISION]` names a repo:

    local = pull("hf://me/fineweb-gpt2", "dataset")    # the snapshot in the hub cache, every file checked

Every pushed repo holds `checksums.sha256` (the `sha256sum -c` format) of all its other files; a pull
checks each file against it, so a file changed in the cache or in transit is one line naming it. The
download is huggingface_hub's `snapshot_download` (resumed by it, and offline with HF_HUB_OFFLINE=1,
which then reads the local cache only).
"""

from __future__ import annotations

import os
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes, sha256_file

HUB_PREFIX = "hf://"
CHECKSUMS = "checksums.sha256"


def is_hub_spec(spec: str) -> bool:
    return str(spec).startswith(HUB_PREFIX)


def link_outside(root: Path, inside: Path) -> tuple[str, str] | None:
    """The first symlink under `root` (a file's or a directory's, links not followed) whose target lies
    outside `inside`: (its path under root, its target), or None. A hub snapshot's files link into its
    repo's blobs; a link anywhere else would pull (or push) a file from outside the tree."""
    inside = Path(inside).resolve()
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(here) / name
            if path.is_symlink():
                target = path.resolve()
                if target != inside and inside not in target.parents:
                    return path.relative_to(root).as_posix(), str(target)
    return None


def parse_hub_spec(spec: str) -> tuple[str, str | None]:
    """'hf://org/name@rev' -> ('org/name', 'rev'); a bare 'org/name' is accepted too."""
    repo_id, _, revision = str(spec).removeprefix(HUB_PREFIX).partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"{spec}: expected hf://ORG/NAME[@REVISION], e.g. hf://me/fineweb-gpt2")
    return repo_id, revision or None


def write_checksums(directory: Path) -> int:
    """DIRECTORY/checksums.sha256 for every other file under it (sorted; `sha256sum -c` reads it).
    -> how many files."""
    directory = Path(directory)
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS and not hidden(p, directory)
    )
    lines = "".join(f"{sha256_file(p)}  {p.relative_to(directory).as_posix()}\n" for p in files)
    atomic_write_bytes(directory / CHECKSUMS, lines.encode())
    return len(files)


def hidden(path: Path, root: Path) -> bool:
    """A dot-file or a file under a dot-directory (staging, caches): never pushed or listed."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def verify_checksums(directory: Path, where: str) -> int:
    """Every file checksums.sha256 lists, against it: a missing or changed file is one line naming it
    and what to do. -> how many files were checked."""
    directory = Path(directory)
    listing = directory / CHECKSUMS
    if not listing.is_file():
        raise UserError(
            f"{where}: no {CHECKSUMS}; not a repo `pretrainer push` wrote, so it cannot be verified"
        )
    outside = link_outside(directory, directory.parents[1] if len(directory.parents) > 1 else directory)
    if outside is not None:  # the snapshot's links point into its repo's cache folder, nowhere else
        raise UserError(f"{where}: {outside[0]} links outside the repo's cache (to {outside[1]}); refused")
    lines = [line for line in listing.read_text().splitlines() if line.strip()]
    listed = {line.partition("  ")[2] for line in lines}
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    unlisted = sorted(present - listed - {CHECKSUMS, ".gitattributes"})
    if unlisted:  # e.g. a stale file an earlier push left: it would be read unverified
        raise UserError(f"{where}: {unlisted[0]} is not in {CHECKSUMS}, so it cannot be verified; push again")
    for line in lines:
        expected, _, name = line.partition("  ")
        if name.startswith("/") or ".." in Path(name).parts:
            raise UserError(f"{where}: {CHECKSUMS} names {name!r}, outside the repo; refused")
        path = directory / name
        if not path.is_file():
            raise UserError(f"{where}: {name} is listed in {CHECKSUMS} but missing; pull it again")
        if sha256_file(path) != expected:
            raise UserError(
                f"{where}: {path} does not match its sha256 in {CHECKSUMS} (changed in the cache or in "
                f"transit); delete it and pull again (huggingface_hub re-downloads a missing file)"
            )
    return len(lines)


def pull(spec: str, repo_type: str, local_dir: Path | None = None, replace: bool = False) -> Path:
    """The repo's snapshot in the hub cache, every file verified; with `local_dir`, then copied there
    (whole, or not at all; `replace`: over a data dir pulled or prepared before)."""
    repo_id, revision = parse_hub_spec(spec)
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo_id=repo_id, repo_type=repo_type, revision=revision))
    except Exception as e:  # network, auth, not in the offline cache: the user's to fix
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(
            f"{spec}: could not pull this {repo_type} from the Hugging Face Hub "
            f"({type(e).__name__}: {first}); check the name, `hf auth login` for a private repo, "
            f"or unset HF_HUB_OFFLINE"
        ) from None
    verify_checksums(local, spec)
    if local_dir is None:
        return local
    import shutil

    from pretrainer.core.files import atomic_directory

    # the cache's links become files
    with atomic_directory(Path(local_dir), kind="data", replace=replace) as tmp:
        shutil.copytree(local, tmp, dirs_exist_ok=True)
    return Path(local_dir)
