"""What the trainer knows of the SLURM job it runs in: its id, when its time limit ends, and which
stop signals mean "checkpoint, requeue the job, exit" (run.requeue_signals), as PyTorch Lightning
does with SIGUSR1: no trap or wrapper is needed in the job script.

    job = SlurmJob.from_env()        # None outside SLURM
    job.end_time                     # epoch seconds (SLURM_JOB_END_TIME, else squeue), or None
    requeue_signal_numbers("auto", job)   # {SIGUSR1, SIGUSR2} in a job, set() outside
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from datetime import datetime

from pretrainer.core.errors import stop_signal_names

AUTO_REQUEUE = ("SIGUSR1", "SIGUSR2")  # what `#SBATCH --signal=USR1@N` sites send before the time limit


@dataclass
class SlurmJob:
    job_id: str
    end_time: float | None  # epoch seconds when the job's time limit ends; None: no limit known
    restart_count: int  # SLURM_RESTART_COUNT: 0 on the first run, then 1, 2, ... after requeues
    warnings: tuple[str, ...] = ()  # SLURM variables with values that mean nothing, said at the start

    @classmethod
    def from_env(cls, environ=None) -> SlurmJob | None:
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID", "")
        if not job_id:
            return None
        end = environ.get("SLURM_JOB_END_TIME", "")
        end_time = float(end) if end.isdigit() and int(end) > 0 else queued_end_time(job_id)
        restarts = environ.get("SLURM_RESTART_COUNT", "0")
        warnings = []
        if end and not end.isdigit():
            warnings.append(
                f"warning: SLURM_JOB_END_TIME = {end[:40]!r} is not epoch seconds; the job's end is "
                + (f"{end_time:.0f} from squeue" if end_time else "unknown, so run.stop_margin_s cannot act")
            )
        if not restarts.isdigit():
            warnings.append(
                f"warning: SLURM_RESTART_COUNT = {restarts[:40]!r} is not a count; taken as 0 (a first run)"
            )
        return cls(job_id, end_time, int(restarts) if restarts.isdigit() else 0, tuple(warnings))


def queued_end_time(job_id: str) -> float | None:
    """The job's end time from `squeue -o %e` (an older SLURM sets no SLURM_JOB_END_TIME)."""
    try:
        said = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout.strip()
        return datetime.fromisoformat(said).timestamp() if said[:1].isdigit() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def requeue_signal_numbers(policy: str, job: SlurmJob | None) -> frozenset[int]:
    """The signals that requeue the job: none outside SLURM; "auto" = USR1, USR2; "none"; or names."""
    if job is None or policy == "none":
        return frozenset()
    names = AUTO_REQUEUE if policy == "auto" else stop_signal_names(policy) or ()
    return frozenset(int(getattr(signal, name)) for name in names)
