"""pretrainer's command line: one verb per job. Each verb parses arguments, builds a config and
calls one function; user errors print one line (`error: ...`) and exit with code 2.

    pretrainer prepare --corpus stdlib --tokenizer bpe:4096 --out data/stdlib-bpe4k
    pretrainer train configs/tiny-cpu.toml --data.dir=data/stdlib-bpe4k --run.dir=runs/tiny
    pretrainer train --run.dir=runs/tiny                     # resume with the run's saved config
    pretrainer sample runs/tiny --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50
    pretrainer chat runs/sft                                 # talk to a model fine-tuned on conversations
    pretrainer eval runs/tiny                                # or a checkpoint, or hf:DIR --data.dir=DIR
    pretrainer export runs/tiny --format hf                  # -> runs/tiny/hf (default: the report,
    runs/tiny/report)
    pretrainer serve-cost runs/tiny --usd-per-hour 0.10      # fp32 vs int8/int4: memory, tokens/s, $/1M
    tokens, quality
    pretrainer plan configs/llama3-1b.toml --gpus 8 --gpu h100-sxm --data.dir=data/fw
    pretrainer sweep configs/sweep-tiny.toml --data.dir=data/stdlib-bpe4k   # a ladder of sizes
    pretrainer fit sweeps/tiny                               # scaling law, intervals, predictions
    pretrainer plan configs/llama3-1b.toml --fit sweeps/tiny/fit.json   # + the predicted final loss
    pretrainer fetch-gpt2
    pretrainer config configs/tiny-cpu.toml --optim.lr=1e-3
"""

from __future__ import annotations

import re
import sys

from pretrainer.cli.output import print_to_stderr
from pretrainer.cli.parser import build_parser, join_dotted_overrides
from pretrainer.cli.verbs_data import cmd_fetch_gpt2, cmd_prepare, cmd_push
from pretrainer.cli.verbs_model import cmd_chat, cmd_eval, cmd_export, cmd_sample, cmd_serve_cost
from pretrainer.cli.verbs_plan import cmd_config, cmd_fit, cmd_plan, cmd_sweep
from pretrainer.cli.verbs_train import cmd_budget_check, cmd_postmortem, cmd_train
from pretrainer.core.end_reasons import COLLECTIVE_TIMEOUT_HINT, end_reason_of
from pretrainer.core.errors import EXIT_USER_ERROR, RunStopped, UserError, missing_package_hint, write_fault
from pretrainer.core.secrets import forget_secrets, redact
from pretrainer.core.streams import Tolerant

DOTTED_OVERRIDE = re.compile(r"^--[a-z][\w-]*\.[\w.-]+=")

# verb -> what it does, given (the parsed arguments, the --section.key=value overrides, the whole argv);
# verbs that return nothing exit 0
VERBS = {
    "prepare": lambda args, extra, argv: cmd_prepare(args, argv),
    "train": lambda args, extra, argv: cmd_train(args, extra),
    "eval": lambda args, extra, argv: cmd_eval(args, extra),
    "plan": lambda args, extra, argv: cmd_plan(args, extra),
    "sweep": lambda args, extra, argv: cmd_sweep(args, extra),
    "fit": lambda args, extra, argv: cmd_fit(args),
    "export": lambda args, extra, argv: cmd_export(args),
    "push": lambda args, extra, argv: cmd_push(args),
    "sample": lambda args, extra, argv: cmd_sample(args),
    "chat": lambda args, extra, argv: cmd_chat(args),
    "serve-cost": lambda args, extra, argv: cmd_serve_cost(args),
    "postmortem": lambda args, extra, argv: cmd_postmortem(args),
    "budget-check": lambda args, extra, argv: cmd_budget_check(args, extra),
    "fetch-gpt2": lambda args, extra, argv: cmd_fetch_gpt2(args),
    "config": lambda args, extra, argv: cmd_config(args, extra),
}


def run_verb(args, extra: list[str], argv: list[str]) -> int:
    try:
        if getattr(args, "checkpoint", "newest") == "best":  # RUN_DIR --checkpoint best: that checkpoint dir
            from pretrainer.artifacts.checkpoint import pick_checkpoint

            where = "target" if args.verb == "eval" else "run"
            if not getattr(args, where):
                raise UserError(f"{args.verb}: --checkpoint best needs a RUN_DIR")
            setattr(args, where, str(pick_checkpoint(getattr(args, where), "best")))
        return VERBS[args.verb](args, extra, argv) or 0
    finally:  # the checkpoints this command read are a trainer's to rotate again
        if "pretrainer.artifacts.checkpoint" in sys.modules:
            sys.modules["pretrainer.artifacts.checkpoint"].release_pins()


def main(argv: list[str] | None = None) -> int:
    forget_secrets()
    argv = join_dotted_overrides(sys.argv[1:] if argv is None else [str(a) for a in argv])
    parser = build_parser()
    # --section.key=VALUE are the config's, whatever VALUE holds: argparse would take one with a space
    # ('--run.dir=/x/my run') for the positional config path
    overrides = [arg for arg in argv if DOTTED_OVERRIDE.match(arg)]
    args, extra = parser.parse_known_args([arg for arg in argv if not DOTTED_OVERRIDE.match(arg)])
    extra = overrides + extra
    if extra and args.verb not in ("train", "eval", "plan", "budget-check", "config", "sweep"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    stdout = sys.stdout
    if args.verb != "train" and not isinstance(stdout, Tolerant):  # train's console tee does the same
        sys.stdout = Tolerant(stdout)
    try:
        return run_verb(args, extra, argv)
    except ModuleNotFoundError as e:
        hint = missing_package_hint(e)
        if hint is None:  # pretrainer's own module: a bug, with its traceback
            raise
        print_to_stderr(f"error: {args.verb}: {hint}")
        return EXIT_USER_ERROR
    except (Exception, KeyboardInterrupt) as e:
        reason = end_reason_of(e)  # the one table of how things end: the code, and what to say
        if reason.name == "crash":
            raise
        print_to_stderr(ending_line(reason, e))
        return reason.exit_code(e)
    finally:
        sys.stdout = stdout


def ending_line(reason, error: BaseException) -> str:
    """What the CLI says, in one line, of a verb that ended with `error` (`reason`'s row)."""
    if reason.name == "collective_timeout":
        return (
            f"error: {COLLECTIVE_TIMEOUT_HINT} ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        )
    if isinstance(error, RunStopped):
        return f"stopped: {error}"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return f"error: {redact(str(write_fault(error) or error))}"


if __name__ == "__main__":
    raise SystemExit(main())
