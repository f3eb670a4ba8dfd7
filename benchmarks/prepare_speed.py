"""Tokenizing speed: `pretrainer prepare` at 1 and N workers against raw tiktoken GPT-2 with N threads over
the same files, in one run; tokens/s of each, prepare's ratio to raw tiktoken (target >= 0.95) and its
scaling from 1 to N workers (target >= 1.7x at 2 workers on 2 cores).

    python benchmarks/prepare_speed.py --make-corpus 200 [--files 8] [--workers 2] [--repeats 3]
    python benchmarks/prepare_speed.py CORPUS [--workers 2]      # a .jsonl or .txt file, or a directory
    python benchmarks/prepare_speed.py --smoke                   # 4 MB, one repeat (CI)

- pretrainer: `prepare(Corpus([CORPUS]), "gpt2", OUT, workers=W)`, what `pretrainer prepare --corpus CORPUS
  --tokenizer gpt2 --workers W` runs, in this process: the corpus cut into units, W spawned workers each
  reading, parsing, hashing (split, de-duplication), encoding and writing its own units (1 worker: in this
  process), the units joined into shards (fsync, sha256), the manifest.
- raw tiktoken: the least a tokenizing pass does: read and parse the same documents in this process,
  `encode_ordinary_batch(batch, num_threads=N)` over batches of N x 1M characters, an end-of-text token
  after each document, uint16 tokens written to one file and fsynced.

Documents: a JSONL line's "text"; in a .txt, the paragraphs between blank lines (for both sides: prepare's
--txt-docs blank-lines). Both load the GPT-2 ranks from pretrainer's offline cache (`pretrainer fetch-gpt2`)
inside the timed part, and neither pays the interpreter's start-up. Runs alternate (prepare 1 worker,
prepare N, raw, prepare 1, ...) --repeats times; the medians are shown. The synthetic corpus is the
standard library's source, one numbered document per file, repeated to the size asked over --files JSONL
files: code, which tokenizes differently from web text. Exit code 1 if the token counts differ where they
must agree (a corpus without duplicate documents), 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrainer.core.errors import UserError
from pretrainer.data.corpus_files import stdlib_files
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.bpe import load_gpt2

BATCH_CHARS = 1 << 20  # per worker per batch, as prepare's BATCH_CHARS


def make_corpus(directory: Path, megabytes: float, files: int) -> list[Path]:
    """Unique documents (numbered copies of the standard library's files) up to `megabytes` of JSONL, in
    `files` files of about equal size."""
    sources = [f.read_text(errors="replace") for f in stdlib_files()]
    directory.mkdir(parents=True, exist_ok=True)
    per_file, i, paths = megabytes * 2**20 / files, 0, []
    for n in range(files):
        path = directory / f"part-{n:03d}.jsonl"
        written = 0
        with open(path, "w", encoding="utf-8") as out:
            while written < per_file:
                line = json.dumps({"text": f"# document {i}\n{sources[i % len(sources)]}"}) + "\n"
                out.write(line)
                written += len(line.encode())
                i += 1
        paths.append(path)
    return paths


def documents(path: Path):
    """The file's documents, as prepare reads them (JSONL "text"; .txt paragraphs between blank lines)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.suffix == ".jsonl":
            for line in f:
                if line.strip() and (text := json.loads(line)["text"]):
                    yield text
            return
        paragraph: list[str] = []
        for line in f:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\r\n")
                paragraph = []
        if paragraph:
            yield "".join(paragraph).rstrip("\r\n")


def raw_tiktoken(paths: list[Path], out: Path, threads: int) -> int:
    """The baseline: parse, encode with tiktoken's own threads, write uint16 tokens. -> tokens written."""
    encoding = load_gpt2().encoding
    eot, tokens = encoding.eot_token, 0

    def encode(batch: list[str]) -> np.ndarray:
        ids = encoding.encode_ordinary_batch(batch, num_threads=threads)
        return np.fromiter(itertools.chain.from_iterable(x + [eot] for x in ids), dtype=np.uint16)

    with open(out, "wb") as sink:
        batch, chars = [], 0
        for text in itertools.chain.from_iterable(documents(path) for path in paths):
            batch.append(text)
            chars += len(text)
            if chars >= threads * BATCH_CHARS:
                tokens += sink.write(encode(batch).tobytes()) // 2
                batch, chars = [], 0
        if batch:
            tokens += sink.write(encode(batch).tobytes()) // 2
        sink.flush()
        os.fsync(sink.fileno())
    return tokens


def pretrainer_prepare(corpus: Path, out: Path, workers: int) -> int:
    """`pretrainer prepare --corpus CORPUS --tokenizer gpt2 --workers N`. -> tokens written (both splits)."""
    # its progress bar
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        manifest = prepare(Corpus([str(corpus)], txt_docs="blank-lines"), "gpt2", out, workers=workers)
    return sum(split["tokens"] for split in manifest["splits"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", help='a .jsonl (a "text" field per line) or .txt file, or a dir')
    parser.add_argument(
        "--make-corpus", type=float, metavar="SIZE_MB", help="write a synthetic JSONL corpus of this size"
    )
    parser.add_argument("--files", type=int, default=8, help="--make-corpus: in this many files")
    parser.add_argument(
        "--workers", type=int, default=2, help="prepare's worker processes and tiktoken's threads (and 1)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a 4 MB synthetic corpus, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.make_corpus, args.repeats = args.make_corpus or 4, 1
    if bool(args.corpus) == bool(args.make_corpus):
        parser.error("give a corpus or --make-corpus SIZE_MB (or --smoke)")

    with tempfile.TemporaryDirectory(prefix="prepare-speed-") as tmp:
        tmp = Path(tmp)
        if args.make_corpus:
            corpus = tmp / "corpus"
            paths = make_corpus(corpus, args.make_corpus, args.files)
        else:
            corpus = Path(args.corpus)
            paths = (
                sorted(p for p in corpus.rglob("*") if p.suffix in (".jsonl", ".txt"))
                if corpus.is_dir()
                else [corpus]
            )
            if not paths or any(p.suffix not in (".jsonl", ".txt") or not p.is_file() for p in paths):
                print(
                    f"error: {corpus}: expected a .jsonl or .txt file, or a directory of them",
                    file=sys.stderr,
                )
                return 2
        megabytes = sum(p.stat().st_size for p in paths) / 2**20
        print(
            f"{corpus.name}: {megabytes:,.1f} MB in {len(paths)} files, GPT-2, 1 and {args.workers} workers, "
            f"{args.repeats} repeats",
            flush=True,
        )
        runs = {
            "prepare, 1 worker": lambda out: pretrainer_prepare(corpus, out, 1),
            f"prepare, {args.workers} workers": lambda out: pretrainer_prepare(corpus, out, args.workers),
            f"raw tiktoken, {args.workers} threads": lambda out: raw_tiktoken(paths, out, args.workers),
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        tokens: dict[str, int] = {}
        try:
            for repeat in range(args.repeats):
                for name, run in runs.items():
                    out = tmp / f"out-{repeat}"
                    started = time.perf_counter()
                    tokens[name] = run(out)
                    seconds[name].append(time.perf_counter() - started)
                    shutil.rmtree(out) if out.is_dir() else out.unlink()
                    print(
                        f"  {name}, repeat {repeat + 1}: {seconds[name][-1]:.2f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    speed = {name: tokens[name] / statistics.median(times) for name, times in seconds.items()}
    print()
    print("| what | tokens/s | MB/s | seconds (median) | spread | tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, times in seconds.items():
        median = statistics.median(times)
        spread = f"{(max(times) - min(times)) / median:.1%}" if len(times) > 1 else "-"
        print(
            f"| {name} | {speed[name]:,.0f} | {megabytes / median:.2f} | {median:.2f} | {spread} | "
            f"{tokens[name]:,} |"
        )
    one, many, raw = (speed[name] for name in runs)
    ratio, scaling = many / raw, many / one
    print(
        f"\nprepare at {args.workers} workers / raw tiktoken at {args.workers} threads: {ratio:.3f} "
        f"({'meets' if ratio >= 0.95 else 'BELOW'} the 0.95 target)\n"
        f"prepare at {args.workers} workers / at 1 worker: {scaling:.2f}x"
        + (f" ({'meets' if scaling >= 1.7 else 'BELOW'} the 1.7x target)" if args.workers == 2 else "")
    )
    same = len(set(tokens.values())) == 1
    if not same:
        print(f"note: token counts differ: {tokens} (prepare drops exact duplicate documents)")
    return 1 if args.make_corpus and not same else 0


if __name__ == "__main__":
    sys.exit(main())
