"""A simulated site image: a fresh venv of the suite's Python whose site-packages holds only torch and
what a GPU node's image preinstalls (benchmarks/site_packages_cuda.txt, read for its names), with
their own dependencies, linked from the suite's venv: no copy, no download. What pretrainer needs
beyond them (rustbpe, zstandard, gguf, the trackers, torchao) is absent, as on such a node."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SITE_LIST = ROOT / "benchmarks" / "site_packages_cuda.txt"
# not on the node, and so not in the image: each must fail to import there
ABSENT = ["mlflow", "wandb", "torchao", "gguf", "zstandard", "rustbpe", "tomli_w"]


def site_names() -> list[str]:
    """The image's packages that exist for this Python and machine (triton is CUDA-only)."""
    names = [re.split(r"[=\s#]", line.strip())[0] for line in SITE_LIST.read_text().splitlines()]
    return [n for n in names if n and n != "triton"]


def closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` need, theirs included, markers evaluated here."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    queue = list(names)
    while queue:
        name = canonicalize_name(queue.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # listed for the node, not installed here: the image is what this machine can make
        seen[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(requirement.name)
    return list(seen.values())


def make_site_image(root: Path) -> Path:
    """root/bin/python: the suite's Python in a venv holding only the image's packages (pip and
    setuptools among them: the node has both). -> that python."""
    # --without-pip: pip comes from the list (ensurepip would install its own copy, seconds of a run)
    subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True
    )
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for dist in closure(site_names()):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            link, target = site / top, Path(dist.locate_file(top))
            if not link.exists() and target.exists():
                link.symlink_to(target)  # a namespace dir shared by several packages is linked once
    return python


def importable(python: Path, modules: list[str]) -> list[str]:
    """Which of `modules` that python finds."""
    code = f"import importlib.util as u; print(','.join(m for m in {modules!r} if u.find_spec(m)))"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return [m for m in out.strip().split(",") if m]
