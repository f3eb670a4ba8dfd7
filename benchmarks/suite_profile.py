"""Where the test suite's time goes: a pytest plugin that records each test's wall time and CPU time (its
worker's and that of the processes it started and waited for), and a report of them.

    PYTHONPATH=$PWD/benchmarks PYTEST_ADDOPTS="-p suite_profile" SUITE_PROFILE=/tmp/suite.jsonl make test
    python benchmarks/suite_profile.py /tmp/suite.jsonl            # per worker, per file, the slowest tests

CPU time includes every process a test started and waited for (torchrun and its workers, a forked rank, a
CLI run); not what SLURM's daemons run for it. A worker's idle gaps (a quiet test waiting for the others
to drain, the others waiting for it) show as its span minus the sum of its tests' wall times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, cpu = time.time(), _cpu()
    try:
        return (yield)
    finally:
        record = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "started": started,
            "wall_s": round(time.time() - started, 3),
            "cpu_s": round(_cpu() - cpu, 3),
        }
        with open(os.environ.get("SUITE_PROFILE", "suite-profile.jsonl"), "a") as out:
            out.write(json.dumps(record) + "\n")


def report(path: str, top: int) -> None:
    records = [json.loads(line) for line in open(path)]
    origin = min(r["started"] for r in records)
    cpu, wall = sum(r["cpu_s"] for r in records), sum(r["wall_s"] for r in records)
    print(f"{len(records)} tests, {cpu:.0f} CPU-s, {wall:.0f} s of test time")
    by_worker = collections.defaultdict(list)
    for r in records:
        by_worker[r["worker"]].append(r)
    for worker, rows in sorted(by_worker.items()):
        end = max(r["started"] + r["wall_s"] for r in rows) - origin
        busy = sum(r["wall_s"] for r in rows)
        print(f"worker {worker or '-'}: ends at {end:.0f} s, busy {busy:.0f} s, idle {end - busy:.0f} s")
    by_file = collections.defaultdict(list)
    for r in records:
        by_file[r["test"].split("::")[0]].append(r)
    print("\n  CPU-s  wall-s  tests  file")
    for name, rows in sorted(by_file.items(), key=lambda kv: -sum(r["wall_s"] for r in kv[1]))[:top]:
        cpu, wall = sum(r["cpu_s"] for r in rows), sum(r["wall_s"] for r in rows)
        print(f"{cpu:7.1f} {wall:7.1f} {len(rows):6d}  {name}")
    print("\n  CPU-s  wall-s  test")
    for r in sorted(records, key=lambda r: -r["wall_s"])[:top]:
        print(f"{r['cpu_s']:7.1f} {r['wall_s']:7.1f}  {r['test']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="the JSON lines the plugin wrote (SUITE_PROFILE)")
    parser.add_argument("--top", type=int, default=25, help="files and tests listed")
    args = parser.parse_args()
    try:
        report(args.records, args.top)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
