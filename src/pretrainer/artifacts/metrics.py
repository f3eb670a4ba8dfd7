"""Where metrics go: metrics.jsonl always (one JSON object per logged step, validation pass or
event, appended and flushed), and the trackers of track.backends. The loop writes to one `RunLog`
(train/tracking.py), which is all of them (and nothing on ranks other than 0).

On resume the file is first cut back to the checkpoint's step (records of steps after it were
written by the interrupted run and will be recomputed), so every step appears exactly once.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pretrainer.core.errors import UserError
from pretrainer.core.files import atomic_write_bytes, naming


def read_metrics(path: Path, note=None) -> list[dict]:
    """The records of a metrics.jsonl. An unparsable *last* line is what a kill or a full disk leaves
    mid-write: it is ignored (and reported to `note`). An unparsable line anywhere else is an error."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if position < len(lines) - 1:
                raise UserError(
                    f"{path}:{number}: not valid JSON in the middle of the file; the metrics are damaged"
                ) from None
            if note is not None:
                note(f"note: {path}:{number}: ignoring a torn last line (the process was killed mid-write)")
    return records


def last_step(path: Path, tail_bytes: int = 1 << 16) -> int:
    """The highest step among the last records of a metrics.jsonl (0 for none): how far a run another
    process trains has got, read from the file's end only, cheaply and while it is being written."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, 2) - tail_bytes))
            lines = file.read().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines[1:] if len(lines) > 1 else lines:  # the first may start mid-record
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except (ValueError, TypeError, AttributeError):  # a torn last line, a record without a step
            continue
    return max(steps)


def run_timings(run_dir: Path) -> dict:
    """The parts of a run's wall time, measured from its metrics (analysis/calibration.py says how each
    is read), and the run's own total: what plan --from-run and --measure plan from, and what a resumed
    run's launch check projects its remaining steps with."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no metrics; --from-run takes a run dir that trained (pretrainer train)")
    records = read_metrics(path)
    logged = [r for r in records if "loss" in r and "elapsed_s" in r and "tokens" in r]
    rates = [r["tokens_per_s"] for r in logged[1:] if r.get("tokens_per_s")]
    if len(logged) < 2 or not rates:
        raise UserError(
            f"{path}: fewer than two logged steps; --from-run needs a run of a few logging intervals "
            f"(lower log.every or train longer)"
        )
    tokens_per_step = logged[-1]["tokens"] / logged[-1]["step"]
    step_s = tokens_per_step / statistics.median(rates)
    at_step = {r["step"]: r["elapsed_s"] for r in logged}
    evals = [r["elapsed_s"] - at_step[r["step"]] for r in records if "val_loss" in r and r["step"] in at_step]
    checkpoints = [r["checkpoint_s"] for r in records if "checkpoint_s" in r]
    first = logged[0]
    return {
        "run_dir": str(run_dir),
        "step_s": step_s,
        "tokens_per_s": statistics.median(rates),
        "eval_s": statistics.median(evals) if evals else None,
        "checkpoint_s": statistics.median(checkpoints) if checkpoints else None,
        "startup_s": max(0.0, first["elapsed_s"] - first["step"] * step_s),
        "tokens_per_step": round(tokens_per_step),
        "run_steps": logged[-1]["step"],
        "run_wall_s": max(r["elapsed_s"] for r in records if "elapsed_s" in r),
    }


class MetricsLog:
    def __init__(self, path: Path, keep_through_step: int):
        """keep_through_step: the resumed checkpoint's step; -1 on a fresh start (an attempt killed before
        its first checkpoint leaves nothing behind)."""
        self.path = Path(path)
        records = read_metrics(self.path, note=print)
        kept = [r for r in records if r.get("step", 0) <= keep_through_step]
        cut = [r for r in records if r.get("step", 0) > keep_through_step]
        # what interrupted launches logged past this checkpoint (the trackers already hold it): this one's
        # and, when a launch was killed again before a newer checkpoint, the ones before
        superseded = self.path.with_name("metrics-superseded.jsonl")
        earlier = [r for r in read_metrics(superseded) if r.get("step", 0) > keep_through_step]
        self.cut = earlier + cut
        if cut:
            with open(superseded, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in cut))
        if self.path.exists() or kept:
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        # non-finite values stay numbers (NaN, Infinity: Python's JSON reads them back as floats), so a
        # divergence is in the data, not a string next to it
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: say which file
            raise naming(e, self.path) from None

    def close(self) -> None:
        self.file.close()
