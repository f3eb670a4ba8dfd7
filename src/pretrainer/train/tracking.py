"""Live tracking: metrics.jsonl and the trackers of track.backends (mlflow, TensorBoard, W&B:
train/trackers.py), behind one `RunLog` that the loop writes to (a no-op on ranks other than 0).

A stop and resume logs every step exactly once in each: the steps after the resumed checkpoint were
logged by the interrupted run, and are computed again bit-exactly. metrics.jsonl is cut back to the
checkpoint; a tracker that rewinds (TensorBoard) takes them again; one that cannot remove a value
(mlflow, W&B) is not sent a (step, key) the interrupted run's metrics.jsonl shows it was sent."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

from pretrainer.artifacts.metrics import MetricsLog
from pretrainer.config.schema import Config
from pretrainer.core.end_reasons import BY_NAME
from pretrainer.core.secrets import redact
from pretrainer.train.component import Component, Step
from pretrainer.train.events import Event
from pretrainer.train.trackers import TRACKERS


class RunLog:
    """metrics.jsonl (cut back to `keep_through_step` on resume) and the trackers, on rank 0; a no-op
    elsewhere. Tracking never stops training: a tracker that fails (unreachable, damaged, deleted, not
    logged in) is reported once and left, and metrics.jsonl keeps every step."""

    def __init__(self, cfg: Config, run_dir: Path, keep_through_step: int, is_main: bool, say):
        if is_main:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.say, self.lock, self.alerts = say, threading.RLock(), None  # alerts: train/alerts.Alerts
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", keep_through_step) if is_main else None
        # (step, key) the interrupted run already sent
        self.sent = {(r.get("step", 0), k) for r in self.metrics.cut for k in r} if is_main else set()
        self.trackers = {}
        for name in cfg.track.backends if is_main else ():
            tracker = self._tracked(name, lambda: open_tracker(name, cfg, run_dir, keep_through_step, say))
            if tracker is not None:
                self.trackers[name] = tracker

    def _tracked(self, name: str, action):
        """action() -> its result; on any failure of tracker `name`, one warning and that tracker is left."""
        try:
            return action()
        except Exception as e:
            problem = redact(
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
            self.say(
                f"warning: {name} failed ({problem[:240]}); training continues without it, metrics.jsonl "
                f"keeps every step"
            )
            self.trackers.pop(name, None)
            return None

    def write(self, record: dict | Event) -> None:
        """A record to metrics.jsonl and the trackers; an event's record, and the event to the alerts."""
        event, record = (record, record.record) if isinstance(record, Event) else (None, record)
        with self.lock:  # the stall watchdog's alert comes from its own thread
            if self.metrics:
                self.metrics.write(record)
            for name, tracker in list(self.trackers.items()):
                unsent = record if tracker.rewinds else self._unsent(record)
                if unsent:
                    self._tracked(name, lambda: tracker.write(unsent))
        if event is not None and self.alerts is not None:  # budget, spikes, throughput: to a person
            self.alerts.on_event(event)

    def _unsent(self, record: dict) -> dict | None:
        if not self.sent or "step" not in record:
            return record
        step = record["step"]
        kept = {k: v for k, v in record.items() if k == "step" or (step, k) not in self.sent}
        return kept if len(kept) > 1 else None

    def close(self, reason: str) -> None:
        """`reason`: why the run ended (train/stopping.py's exit reasons)."""
        with self.lock:
            self._close(reason)

    def _close(self, reason: str) -> None:
        if self.metrics:
            self.metrics.close()
        status = BY_NAME[reason].tracker_status  # FINISHED, KILLED (on purpose) or FAILED
        for name, tracker in list(self.trackers.items()):
            self._tracked(name, lambda: tracker.close(status))
        self.metrics, self.trackers = None, {}  # a late write (another thread's) is then a no-op


def open_tracker(name: str, cfg: Config, run_dir: Path, keep_through_step: int, say):
    """The tracker `name` of track.backends; None (with a note) when its package is not installed."""
    tracker = TRACKERS[name]
    if importlib.util.find_spec(tracker.package) is None:
        say(
            f"note: {name} is not installed ({tracker.install}, or pip install -e '.[track]'); the run goes "
            f"on without it"
        )
        return None
    return tracker.open(cfg, run_dir, keep_through_step, say)


class SequenceLog(Component):
    """log.sequences: the window ids each rank read per step, in sequences-rankR.jsonl, cut back on
    resume like metrics.jsonl (an audit that a resume reads exactly what a straight run reads)."""

    name = "sequences"

    def __init__(self, path: Path, keep_through_step: int, loader):
        self.file, self.loader = MetricsLog(path, keep_through_step), loader

    @classmethod
    def build(cls, trainer) -> SequenceLog | None:
        if not trainer.cfg.log.sequences:
            return None
        path = trainer.run_dir / f"sequences-rank{trainer.env.rank}.jsonl"
        return cls(path, trainer.start_step, trainer.loader)

    def after_step(self, step: Step) -> None:
        ids = [i for micro in self.loader.last_step_ids for i in micro]
        self.file.write({"step": step.number, "ids": ids})

    def close(self) -> None:
        self.file.close()
