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
    previous = stop_on_signals(f"prepare: nothing was written to {args.out}")
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
    )


def pull_prepared(args: argparse.Namespace) -> None:
    """prepare --from-hub: the pushed data dir, every file against checksums.sha256 and the token files
    against manifest.json (data.verify = full)."""
    from pretrainer.data.hub import HUB_PREFIX, pull
    from pretrainer.data.loader import open_data_dir
    from pretrainer.data.verify import verify_data

    if args.corpus:
        raise UserError("prepare: --from-hub pulls data already prepared; drop --corpus")
    spec = args.from_hub if args.from_hub.startswith(HUB_PREFIX) else HUB_PREFIX + args.from_hub
    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        if not args.force:
            raise UserError(f"{out}: already exists; pass --force to replace it (once the pull is verified)")
        from pretrainer.core.files import refuse_to_replace
        from pretrainer.data.prepare import is_prepared_dir

        refuse_to_replace(out, is_prepared_dir, "a prepared data dir")  # --force never removes anything else
    local = pull(spec, "dataset", local_dir=out)
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
