"""Peak memory of `pretrainer prepare` on one large .txt file: does it stay flat in the file size?

    python benchmarks/prepare_memory.py --mb 1024 [--tokenizer gpt2] [--workers 2] [--txt-docs auto]

Writes a .txt of MB megabytes of unique paragraphs (the standard library's source, each paragraph
numbered, blank lines between them), runs `pretrainer prepare` on it and samples the peak resident
set (VmHWM) of the main process and of each tokenizer worker from /proc until it exits.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrainer.data.corpus_files import stdlib_files


def write_text(path: Path, megabytes: int) -> None:
    paragraphs = [
        p for f in stdlib_files()[:400] for p in f.read_text(errors="replace").split("\n\n") if p.strip()
    ]
    target, written, i = megabytes * 2**20, 0, 0
    with open(path, "w") as out:
        while written < target:
            chunk = f"# paragraph {i}\n{paragraphs[i % len(paragraphs)]}\n\n"
            out.write(chunk)
            written += len(chunk.encode())
            i += 1


def tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(stat.parent.name)
            )
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--txt-docs", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        write_text(text, args.mb)
        cmd = [
            sys.executable,
            "-m",
            "pretrainer",
            "prepare",
            "--corpus",
            str(text),
            "--tokenizer",
            args.tokenizer,
            "--workers",
            str(args.workers),
            "--txt-docs",
            args.txt_docs,
            "--out",
            str(Path(tmp) / "out"),
        ]
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        peaks: dict[int, float] = {}
        while proc.poll() is None:
            for pid in tree(proc.pid):
                try:
                    hwm = next(
                        line
                        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("VmHWM")
                    )
                    peaks[pid] = max(peaks.get(pid, 0.0), int(hwm.split()[1]) / 1024)
                except (OSError, StopIteration):
                    continue
            time.sleep(0.1)
        seconds = time.time() - started
        out = proc.stdout.read()
    main_peak = peaks.pop(proc.pid, 0.0)
    print(out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}")
    print(
        f"{args.mb} MB .txt, {args.tokenizer}, {args.workers} workers, --txt-docs {args.txt_docs}: "
        f"{seconds:.1f} s "
        f"({args.mb / seconds:.1f} MB/s); peak RSS main process {main_peak:.0f} MB, largest worker "
        f"{max(peaks.values(), default=0):.0f} MB, all processes together at most "
        f"{main_peak + sum(peaks.values()):.0f} MB"
    )


if __name__ == "__main__":
    main()
