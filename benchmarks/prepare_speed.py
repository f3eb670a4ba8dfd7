"""Tokenizing speed: `pretrainer prepare` against raw tiktoken GPT-2 on the same file with the same
number of workers; MB/s of each and their ratio (target: pretrainer >= 0.90 x raw tiktoken).

    python benchmarks/prepare_speed.py CORPUS.jsonl [--workers 2] [--repeats 3]     # or a .txt
    python benchmarks/prepare_speed.py --make-jsonl 200 [--workers 2]              # a synthetic 200 MB JSONL
    first
    python benchmarks/prepare_speed.py --smoke                                      # 4 MB, seconds (CI)

- pretrainer: `prepare(Corpus([FILE]), "gpt2", OUT, workers=N)`, what `pretrainer prepare --corpus FILE
  --tokenizer gpt2 --workers N` runs, in this process: read and parse, hash each document for the
  validation split and de-duplication, encode in N spawned worker processes, write train.bin and
  val.bin (fsync, sha256) and the manifest.
- raw tiktoken: the least a tokenizing pass does: read and parse the same documents in this process,
  `encode_ordinary_batch(batch, num_threads=N)` over batches of N x 1M characters, an end-of-text
  token after each document, uint16 tokens written to one file and fsynced, as prepare does.

Documents: a JSONL line's "text"; in a .txt, the paragraphs between blank lines (for both sides:
prepare's --txt-docs blank-lines, which it uses anyway for a .txt over 64 MiB; a smaller one would be
a single document, which prepare cannot split into train and val).

Both load the GPT-2 ranks from pretrainer's offline cache (`pretrainer fetch-gpt2`) inside the timed
part, and neither pays the interpreter's start-up (the CLI adds that once). Runs alternate (pretrainer,
raw, pretrainer, ...) --repeats times; the medians are shown. MB = 2^20 bytes of the input file. The
synthetic JSONL is the standard library's source, one numbered document per file, repeated to
the size asked: code, which tokenizes differently from web text. Exit code 1 if the two token counts
differ where they must agree (a JSONL without duplicate documents), 2 for bad input.
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


def make_jsonl(path: Path, megabytes: float) -> None:
    """Unique documents (numbered copies of the standard library's files) up to `megabytes` of JSONL."""
    sources = [f.read_text(errors="replace") for f in stdlib_files()]
    target, written = megabytes * 2**20, 0
    with open(path, "w", encoding="utf-8") as out:
        for i in itertools.count():
            line = json.dumps({"text": f"# document {i}\n{sources[i % len(sources)]}"}) + "\n"
            out.write(line)
            written += len(line.encode())
            if written >= target:
                return


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


def raw_tiktoken(path: Path, out: Path, workers: int) -> int:
    """The baseline: parse, encode with tiktoken's own threads, write uint16 tokens. -> tokens written."""
    encoding = load_gpt2().encoding
    eot, tokens = encoding.eot_token, 0

    def encode(batch: list[str]) -> np.ndarray:
        ids = encoding.encode_ordinary_batch(batch, num_threads=workers)
        return np.fromiter(itertools.chain.from_iterable(x + [eot] for x in ids), dtype=np.uint16)

    with open(out, "wb") as sink:
        batch, chars = [], 0
        for text in documents(path):
            batch.append(text)
            chars += len(text)
            if chars >= workers * BATCH_CHARS:
                tokens += sink.write(encode(batch).tobytes()) // 2
                batch, chars = [], 0
        if batch:
            tokens += sink.write(encode(batch).tobytes()) // 2
        sink.flush()
        os.fsync(sink.fileno())
    return tokens


def pretrainer_prepare(path: Path, out: Path, workers: int) -> int:
    """`pretrainer prepare --corpus PATH --tokenizer gpt2 --workers N`. -> tokens written (both splits)."""
    # its progress bar
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        manifest = prepare(Corpus([str(path)], txt_docs="blank-lines"), "gpt2", out, workers=workers)
    return sum(split["tokens"] for split in manifest["splits"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", help='a .jsonl (a "text" field per line) or .txt file')
    parser.add_argument(
        "--make-jsonl", type=float, metavar="SIZE_MB", help="write a synthetic JSONL of this size and use it"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="prepare's worker processes and tiktoken's threads (default: as prepare's, CPU count up to 8)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a 4 MB synthetic JSONL, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.make_jsonl, args.repeats = args.make_jsonl or 4, 1
    if bool(args.corpus) == bool(args.make_jsonl):
        parser.error("give a corpus file or --make-jsonl SIZE_MB (or --smoke)")

    with tempfile.TemporaryDirectory(prefix="prepare-speed-") as tmp:
        tmp = Path(tmp)
        if args.make_jsonl:
            path = tmp / "synthetic.jsonl"
            make_jsonl(path, args.make_jsonl)
        else:
            path = Path(args.corpus)
            if path.suffix not in (".jsonl", ".txt") or not path.is_file():
                print(f"error: {path}: expected an existing .jsonl or .txt file", file=sys.stderr)
                return 2
        megabytes = path.stat().st_size / 2**20
        print(
            f"{path.name}: {megabytes:,.1f} MB, GPT-2, {args.workers} workers, {args.repeats} repeats",
            flush=True,
        )
        seconds: dict[str, list[float]] = {"pretrainer prepare": [], "raw tiktoken": []}
        tokens: dict[str, int] = {}
        try:
            for repeat in range(args.repeats):
                for name, run in (("pretrainer prepare", pretrainer_prepare), ("raw tiktoken", raw_tiktoken)):
                    out = tmp / f"out-{repeat}"
                    started = time.perf_counter()
                    tokens[name] = run(path, out, args.workers)
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

    speed = {name: megabytes / statistics.median(times) for name, times in seconds.items()}
    print()
    print("| what | MB/s | seconds (median) | spread | tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, times in seconds.items():
        spread = f"{(max(times) - min(times)) / statistics.median(times):.1%}" if len(times) > 1 else "-"
        print(
            f"| {name} | {speed[name]:.2f} | {statistics.median(times):.2f} | {spread} | {tokens[name]:,} |"
        )
    ratio = speed["pretrainer prepare"] / speed["raw tiktoken"]
    print(
        f"\npretrainer / raw tiktoken: {ratio:.3f} ({'meets' if ratio >= 0.90 else 'BELOW'} the 0.90 target)"
    )
    same = tokens["pretrainer prepare"] == tokens["raw tiktoken"]
    if not same:
        print(
            f"note: token counts differ by {tokens['pretrainer prepare'] - tokens['raw tiktoken']:+,} "
            f"(prepare drops exact "
            f"duplicate documents)"
        )
    return 1 if args.make_jsonl and not same else 0


if __name__ == "__main__":
    sys.exit(main())
