"""What happens once a run has ended and its exit record is on disk: the SLURM job is requeued when
the stop asked for it, otherwise the user's `run.on_exit` command runs, once.

    record = write_exit_record(...)        # RUN_DIR/exit.json, after the final checkpoint
    after_the_run(record, cfg.run.on_exit, cfg.run.on_exit_timeout_s)

Who calls it: the trainer itself (rank 0) when it runs alone or under a plain torchrun; under
`pretrainer train --nproc N` the launcher, once torchrun and every worker are gone (a worker still
busy with a hook would be killed by torchrun as soon as another rank exits non-zero). Imports no
torch: the launcher uses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pretrainer.core.files import atomic_write_json
from pretrainer.core.streams import print_line

LAUNCHER_ONLY = ("on_exit", "on_exit_timeout_s")  # in the launcher's copy of the record only
HOOK_ENV = {  # the environment run.on_exit sees: why the run ended, and where it is
    "PRETRAINER_EXIT_REASON": "reason",
    "PRETRAINER_EXIT_CODE": "exit_code",
    "PRETRAINER_STEP": "step",
    "PRETRAINER_RUN_DIR": "run_dir",
    "PRETRAINER_CHECKPOINT": "checkpoint",
}


def tell(text: str) -> None:
    """One line on stderr; a console that is gone is no error (the run's files say it all)."""
    print_line(text, sys.stderr, last_words=True)


def after_the_run(record: dict, on_exit: str, timeout_s: float) -> dict:
    """Requeue the SLURM job (record["requeued"]), or run `on_exit` with the record in its
    environment. A requeue that fails ends the run for real: the record says so and the hook runs.
    -> the record as it finally stands."""
    if record.get("requeued"):
        problem = requeue_slurm_job(os.environ.get("SLURM_JOB_ID", ""))
        if problem is None:
            return record  # the run goes on in the requeued job: no hook
        record = {**record, "requeued": False, "message": f"{record['message']}; {problem}"}
        tell(f"warning: {problem}; the run stays stopped")
        rewrite_exit_record(record)
    if on_exit:
        run_exit_hook(on_exit, record, timeout_s)
    return record


def requeue_slurm_job(job_id: str) -> str | None:
    """`scontrol requeue JOB_ID`: None when SLURM took it, else why not (one line)."""
    if not job_id:
        return "cannot requeue: SLURM_JOB_ID is not set"
    main_thread = threading.current_thread() is threading.main_thread()
    # SLURM ends this copy of the job with SIGTERM at once: everything is saved, let it finish saying so
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main_thread else None
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=False
        )
        problem = None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            problem = f"scontrol requeue {job_id} failed: {said[-1] if said else f'exit {done.returncode}'}"
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"scontrol requeue {job_id} failed ({e})"
    if problem is not None:
        if main_thread:  # not requeued: SIGTERM means what it meant again (the hook inherits it)
            signal.signal(signal.SIGTERM, previous)
        return problem
    tell(f"pretrainer: SLURM job {job_id} requeued; it resumes from the checkpoint")
    return None


def run_exit_hook(command: str, record: dict, timeout_s: float) -> int | None:
    """`command` in a shell with the record in its environment, its output on ours; stopped after
    timeout_s. -> its exit code (None: it could not run or was stopped). Never raises: the run's
    files are already safe, and the hook's failure is said in one line."""
    shown = lambda value: "" if value is None else str(value)  # noqa: E731 (0 is a step and a code)
    env = {**os.environ, **{name: shown(record.get(key)) for name, key in HOOK_ENV.items()}}
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    try:  # its own process group: a timeout stops the command and everything it started
        hook = subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True)
    except OSError as e:
        tell(f"warning: run.on_exit could not run ({e.strerror})")
        return None
    try:
        code = hook.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(hook.pid, signal.SIGKILL)
        hook.wait()
        tell(f"warning: run.on_exit was stopped after {timeout_s:g} s")
        return None
    if code != 0:
        tell(f"warning: run.on_exit exited {code}")
    return code


def rewrite_exit_record(record: dict) -> None:
    """RUN_DIR/exit.json again, after a failed requeue (the run no longer continues)."""
    if not record.get("run_dir") or not Path(record["run_dir"]).is_dir():
        return
    try:
        kept = {key: value for key, value in record.items() if key not in LAUNCHER_ONLY}
        atomic_write_json(Path(record["run_dir"]) / "exit.json", kept)
    except OSError as e:
        tell(f"warning: {record['run_dir']}/exit.json: cannot rewrite it ({e.strerror})")
