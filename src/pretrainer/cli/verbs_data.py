"""The data verbs: `prepare` (corpus -> tokenizer -> token files + manifest, or --from-hub), `push` (a data
dir or a run to the Hub) and `fetch-gpt2`."""

from __future__ import annotations

import argparse
import shlex
import signal
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.secrets import redact


def cmd_prepare(args: argparse.Namespace, argv: list[str]) -> None:
    from pretrainer.data.sources import Corpus

    if args.from_hub:
        return pull_prepared(args)
    if not args.corpus or not args.out:
        raise UserError("prepare: give --corpus and --out (or --from-hub ORG/NAME to pull prepared data)")
    corpus = Corpus(
        args.corpus,
        txt_docs=args.txt_docs,
        utf8_errors=args.utf8_errors,
        column="messages" if args.format == "chat" else "text",
        on_bad=args.on_bad,
    )
    previous = stop_on_signals(
        f"prepare: nothing was written to {args.out}; the same command continues from the units done"
    )
    try:
        _prepare(args, argv, corpus)
    finally:  # the caller's handlers again (in-process callers, tests)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _prepare(args: argparse.Namespace, argv: list[str], corpus) -> None:
    from pretrainer.data.prepare import prepare

    prepare(
        corpus,
        args.tokenizer,
        Path(args.out),
        val_fraction=args.val_fraction,
        seed=args.seed,
        workers=args.workers,
        max_docs=args.max_docs,
        force=args.force,
        command=redact("pretrainer " + shlex.join(argv)),
        fmt=args.format,
        tokenizer_from=args.tokenizer_from or "",
        eot_token=args.eot_token,
        shard_tokens=args.shard_tokens,
        part=args.part,
        merge=args.merge,
    )


def pull_prepared(args: argparse.Namespace) -> None:
    """prepare --from-hub: the pushed data dir, every file against checksums.sha256 and the token files
    against manifest.json (data.verify = full)."""
    from pretrainer.data.data_dir import open_data_dir
    from pretrainer.data.hub import HUB_PREFIX, pull
    from pretrainer.data.verify import verify_data

    if args.corpus:
        raise UserError("prepare: --from-hub pulls data already prepared; drop --corpus")
    spec = args.from_hub if args.from_hub.startswith(HUB_PREFIX) else HUB_PREFIX + args.from_hub
    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        if not args.force:
            raise UserError(f"{out}: already exists; pass --force to replace it (once the pull is verified)")
    if out is not None:
        from pretrainer.core.ownership import check_replaceable

        check_replaceable(out, "data")  # --force never removes anything else
    local = pull(spec, "dataset", local_dir=out, replace=args.force)
    checked = verify_data(open_data_dir(local), "full")
    print(
        f"pulled {spec} to {local}: every file matches checksums.sha256, and {checked['chunks_checked']} "
        f"chunks of token files match manifest.json\n"
        f"train on it: --data.dir={shlex.quote(str(out) if out else spec)}"
    )


def cmd_push(args: argparse.Namespace) -> None:
    from pretrainer.analysis.publish import push

    push(
        Path(args.path),
        args.repo_id,
        private=args.private,
        revision=args.revision,
        dry_run=args.dry_run,
        dtype=args.dtype,
    )


def stop_on_signals(message: str) -> dict:
    """SIGTERM and SIGHUP stop the command as Ctrl-C does: the temp output is removed on the way out
    (their default action would kill the process and leave it), exit 128 + N. -> the handlers before."""
    from pretrainer.core.errors import RunStopped, exit_code_for_signal

    def stop(signum, frame):
        raise RunStopped(f"{signal.Signals(signum).name}: {message}", exit_code_for_signal(signum))

    return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}


def cmd_fetch_gpt2(args: argparse.Namespace) -> None:
    from pretrainer.data.tokenizers.bpe import fetch_gpt2_ranks

    path = fetch_gpt2_ranks(Path(args.dest) if args.dest else None)
    print(f"GPT-2 ranks ready at {path} (sha256 verified)")


# --- the command line's grammar for these verbs (cli/parser.py lists them) ---


def add_prepare(verbs) -> None:
    """`pretrainer prepare`'s arguments and help."""
    from pretrainer.data.shards import SHARD_TOKENS

    p = verbs.add_parser("prepare", help="corpus -> tokenizer -> token files + manifest")
    p.add_argument(
        "--corpus",
        action="append",
        help="stdlib | PATH (.txt/.jsonl/.parquet file, dir or glob; .gz/.zst/.bz2/.xz too) | "
        "hf:ORG/NAME[:GLOB]; repeatable",
    )
    p.add_argument(
        "--from-hub",
        metavar="ORG/NAME[@REV]",
        help="instead of --corpus: pull a data dir `pretrainer push` uploaded and verify every file (into "
        "--out, or the hub cache without it)",
    )
    p.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2 (tiktoken GPT-2 BPE), bpe:N (train a BPE of vocab N) or hf:DIR_OR_REPO (a Hugging Face "
        "tokenizer.json: a local directory, or a hub repo id, read from the local hub cache offline)",
    )
    p.add_argument(
        "--eot-token",
        metavar="NAME",
        default="",
        help="hf: tokenizers: the token that ends each document (default: <|endoftext|>, <|end_of_text|>, "
        "</s>, <eos> or <|eos|> among its special tokens, else its post-processor's or config's eos)",
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="RUN_OR_DATA_DIR",
        help="reuse this run's (or data dir's) tokenizer exactly instead of --tokenizer (chat: plus the chat "
        "tokens)",
    )
    p.add_argument(
        "--format",
        default="text",
        choices=["text", "chat"],
        help="text: documents (a 'text' field/column); chat: conversations (a 'messages' list of {role, "
        "content} "
        "per JSONL line or parquet row) in the chat template, with a loss mask on the assistant's tokens",
    )
    p.add_argument(
        "--on-bad",
        default="error",
        choices=["error", "skip"],
        help="chat: a malformed conversation is an error naming file and line (default), or skipped and "
        "counted",
    )
    p.add_argument("--out", help="output data directory (must not exist unless --force)")
    p.add_argument(
        "--val-fraction", type=float, default=0.005, help="fraction of documents held out for validation"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document-level validation split")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizer processes, each reading its own units of the corpus (default: the cores this "
        "process may use)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=SHARD_TOKENS,
        help=f"tokens per token file (train-00000.bin, ...; default {SHARD_TOKENS:,}: 512 MiB of uint16)",
    )
    p.add_argument(
        "--part",
        metavar="I/N",
        default="",
        help="tokenize only the I-th of N slices of the corpus into OUT.prepare/ (a SLURM array task per "
        "part, on a filesystem they share); then the same command with --merge writes OUT",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="join the units every --part tokenized into OUT (the same command, without --part); equal to "
        "one prepare of the whole corpus",
    )
    p.add_argument(
        "--txt-docs",
        default="auto",
        choices=["auto", "file", "blank-lines"],
        help=".txt documents: one per file, split on blank lines, or auto (one per file; files over 64 MiB "
        "are split on blank lines)",
    )
    p.add_argument(
        "--utf8-errors",
        default="replace",
        choices=["replace", "strict"],
        help="invalid UTF-8: replace with U+FFFD and count (default), or reject with an error",
    )
    p.add_argument("--max-docs", type=int, default=0, help="use only the first N documents (0 = all)")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it exists (only once the new data is complete)"
    )


def add_push(verbs) -> None:
    """`pretrainer push`'s arguments and help."""
    p = verbs.add_parser(
        "push",
        help="a prepared data dir, or a run as a Hugging Face export, to the Hugging Face Hub",
        epilog="examples: pretrainer push data/fw-gpt2 me/fw-gpt2;  "
        "pretrainer push runs/x1 me/x1-50m --dry-run",
    )
    p.add_argument("path", metavar="DATA_DIR_OR_RUN_DIR", help="a `pretrainer prepare` output or a run dir")
    p.add_argument(
        "repo_id", metavar="ORG/NAME", help="the Hub repo (a dataset repo for data, a model repo for a run)"
    )
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="a branch to push to (created if missing; default main)")
    p.add_argument(
        "--dtype", default="bf16", choices=["fp32", "bf16"], help="a run's exported weights (default bf16)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="stage the files, card and checksums in PATH/.hub-push only"
    )


def add_fetch_gpt2(verbs) -> None:
    """`pretrainer fetch-gpt2`'s arguments and help."""
    p = verbs.add_parser("fetch-gpt2", help="download and verify the GPT-2 BPE ranks for offline use")
    p.add_argument(
        "--dest", help="where to write gpt2.tiktoken (default: $PRETRAINER_CACHE or ~/.cache/pretrainer)"
    )
