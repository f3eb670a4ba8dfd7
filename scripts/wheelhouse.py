"""The wheels pretrainer needs on a machine that cannot reach a package index (an air-gapped GPU node
with its site's own PyTorch), downloaded here, where PyPI answers, to travel with the tree.

    python scripts/wheelhouse.py --out WHEELHOUSE --have-python /path/to/the/target/python
    python scripts/wheelhouse.py --out WHEELHOUSE --have FREEZE.txt --python-version 3.12

and then, on the target, from the repository's root (no network):

    python -m pip install --no-index --find-links WHEELHOUSE -e .

What the target already has is left out: --have-python asks that interpreter (its version, platform and
installed distributions), --have reads a `pip list --format=freeze` of it (a name without a version counts
as present). Everything else pretrainer needs (pyproject's dependencies and --extras, then theirs,
recursively, with markers evaluated for the target) is downloaded as a binary wheel for the target's
Python and platform, one version each, and so is the build backend (pip builds the editable install
in an isolated environment, which it fills from the wheelhouse whatever the target has). The target's
torch is never replaced: one that does not satisfy pretrainer's range is an error. Prints each wheel,
its size and the total; exits 1 above --max-mib (the device tool carries 64 MiB of tree in all).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# manylinux wheels a glibc-2.17-or-newer Linux takes (pip matches each --platform exactly)
MANYLINUX = ["manylinux1", "manylinux2010", "manylinux2014"] + [f"manylinux_2_{n}" for n in range(17, 40)]
NEVER_REPLACED = {"torch"}  # the site's build (CUDA, drivers): a wheel from PyPI would not be one
ASK_TARGET = (
    "import importlib.metadata as m, json, platform, sys; print(json.dumps({'python': '%d.%d' % "
    "sys.version_info[:2], 'machine': platform.machine(), 'have': {d.metadata['Name']: d.version "
    "for d in m.distributions() if d.metadata['Name']}}))"
)


class Refused(Exception):
    pass


def target_of(args) -> tuple[str, str, dict[str, str | None]]:
    """(python version "3.12", machine "x86_64", {canonical name: version or None})."""
    if args.have_python:
        try:
            out = subprocess.run(
                [args.have_python, "-c", ASK_TARGET], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError) as e:
            raise Refused(f"--have-python {args.have_python}: cannot ask it what it has ({e})") from None
        found = json.loads(out.stdout)
        have = {canonicalize_name(name): version for name, version in found["have"].items()}
        return found["python"], found["machine"], have
    have: dict[str, str | None] = {}
    for number, line in enumerate(Path(args.have).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)\s*(?:==\s*([^\s;]+))?", line)
        if not match:
            raise Refused(f"{args.have}:{number}: expected NAME or NAME==VERSION, got {line!r}")
        have[canonicalize_name(match.group(1))] = match.group(2)
    return args.python_version, args.machine, have


def markers_env(python: str, machine: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
    }


def satisfied(requirement: Requirement, version: str | None) -> bool:
    """A local build (2.11.0+cu130) satisfies what its public version does; an unknown version, anything."""
    if version is None:
        return True
    return requirement.specifier.contains(Version(version).public, prereleases=True)


def download(requirements: list[Requirement], python: str, machine: str, out: Path) -> list[Path]:
    """One binary wheel for the target of each requirement (distinct names) into `out`, in one pip
    call, no dependencies (they are resolved here, against the target)."""
    platforms = [arg for tag in MANYLINUX for arg in ("--platform", f"{tag}_{machine}")]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        command += ["--python-version", python, "--implementation", "cp", *platforms, "-d", tmp]
        result = subprocess.run([*command, *map(str, requirements)], capture_output=True, text=True)
        wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in Path(tmp).glob("*.whl")}
        missing = [r for r in requirements if canonicalize_name(r.name) not in wheels]
        if result.returncode != 0 or missing:
            last = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            names = ", ".join(map(str, missing or requirements))
            raise Refused(f"no wheel of {names} for Python {python} on {machine}: {last}")
        return [Path(shutil.move(w, out / w.name)) for w in wheels.values()]


def merged(a: Requirement, b: Requirement) -> Requirement:
    """Both requirements on one package as one (pip takes a name once per call)."""
    extras = f"[{','.join(sorted(a.extras | b.extras))}]" if a.extras | b.extras else ""
    return Requirement(f"{a.name}{extras}{a.specifier & b.specifier}")


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's own Requires-Dist (its dist-info's METADATA, not a vendored one)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = archive.read(metadata).decode()
    return [
        Requirement(line.split(":", 1)[1].strip())
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def wanted(extras: list[str]) -> list[Requirement]:
    """pyproject's dependencies, the named extras' and the build backend's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = list(project["project"]["dependencies"]) + list(project["build-system"]["requires"])
    optional = project["project"].get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise Refused(f"--extras {extra}: pyproject.toml has no such extra ({', '.join(optional)})")
        lines += optional[extra]
    return [Requirement(line) for line in lines]


def build_wheelhouse(args) -> list[Path]:
    python, machine, have = target_of(args)
    env = markers_env(python, machine)
    build_backend = {
        canonicalize_name(Requirement(r).name)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    }
    pending, got = wanted(args.extras), {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    while pending:  # one round per level of the dependency tree, one pip call per round
        needed: dict[str, Requirement] = {}
        for requirement in pending:
            if requirement.marker is not None and not requirement.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(requirement.name)
            if name in got:
                if not satisfied(requirement, got[name][1]):
                    raise Refused(
                        f"{requirement} conflicts with the {got[name][1]} already chosen for another package"
                    )
                continue
            if name in have and name not in build_backend:
                if satisfied(requirement, have[name]):
                    continue
                if name in NEVER_REPLACED:
                    raise Refused(
                        f"the target's {name} {have[name]} does not satisfy {requirement}; "
                        f"pretrainer needs a newer site build"
                    )
            needed[name] = merged(needed[name], requirement) if name in needed else requirement
        pending = []
        for wheel in download(list(needed.values()), python, machine, out) if needed else []:
            name, version = parse_wheel_filename(wheel.name)[:2]
            got[canonicalize_name(name)] = (wheel, str(version))
            pending += wheel_requirements(wheel)
    chosen = {path for path, _ in got.values()}
    for stale in set(out.glob("*.whl")) - chosen:  # an earlier run's: two versions of one stop pip
        stale.unlink()
    return sorted(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the wheelhouse directory (created; wheels added)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--have-python", help="the target's python, on this machine: asked what it has")
    source.add_argument("--have", help="a `pip list --format=freeze` of the target")
    parser.add_argument("--python-version", default="3.12", help="with --have: the target's Python (3.12)")
    parser.add_argument("--machine", default="x86_64", help="with --have: the target's machine (x86_64)")
    parser.add_argument("--extras", default="", help="comma-separated extras of pretrainer's to bring too")
    parser.add_argument("--max-mib", type=float, default=16.0, help="refuse a wheelhouse larger than this")
    args = parser.parse_args()
    args.extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    try:
        wheels = build_wheelhouse(args)
    except (Refused, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(w.stat().st_size for w in wheels)
    for wheel in sorted(wheels):
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.2f} MiB  in {len(wheels)} wheels: {args.out}")
    if total > args.max_mib * 2**20:
        print(
            f"error: the wheelhouse is {total / 2**20:.1f} MiB, over --max-mib {args.max_mib}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
