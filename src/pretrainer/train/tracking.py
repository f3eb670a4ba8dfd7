"""Live tracking: mlflow (when installed and enabled) beside metrics.jsonl, behind one `RunLog` that the
loop writes to (a no-op on ranks other than 0)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

from pretrainer.artifacts.metrics import MetricsLog
from pretrainer.config.schema import Config, config_text, flatten
from pretrainer.core.files import atomic_write_bytes
from pretrainer.core.secrets import lost_secret, redact, reveal


class MlflowLogger:
    """The same records to mlflow, through MlflowClient (no global mlflow state). The default store
    is sqlite inside the run dir; a resumed run continues the same mlflow run (its id is kept in
    RUN_DIR/mlflow-run-id.txt). View with: mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db"""

    def __init__(self, run_dir: Path, uri: str, experiment: str, params: dict[str, object], config_text: str):
        import logging

        # importing mlflow configures its loggers: quieten them after
        from mlflow.tracking import MlflowClient

        # their INFO lines (database migrations) would land mid-output, and their ERROR tracebacks: RunLog
        # reports a failing store in one line
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

        run_dir = Path(run_dir).resolve()
        self.uri = uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=reveal(self.uri))  # the one place credentials are used
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found
            else self.client.create_experiment(
                experiment, artifact_location=(run_dir / "mlflow-artifacts").as_uri() if not uri else None
            )
        )
        id_file = run_dir / "mlflow-run-id.txt"
        self.run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])
            self.client.log_text(self.run_id, config_text, "config.toml")
            atomic_write_bytes(id_file, (self.run_id + "\n").encode())

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        step, now_ms = int(record.get("step", 0)), int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now_ms, step)
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class RunLog:
    """metrics.jsonl (cut back to `keep_through_step` on resume) and mlflow, on rank 0; a no-op elsewhere.
    Tracking never stops training: a store that fails (unreachable, damaged, deleted) is reported once
    and left, and metrics.jsonl keeps every step."""

    def __init__(self, cfg: Config, run_dir: Path, keep_through_step: int, is_main: bool, say):
        if is_main:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.say, self.lock, self.alerts = say, threading.RLock(), None  # alerts: train/alerts.Alerts
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", keep_through_step) if is_main else None
        self.tracker = self._tracked(lambda: open_tracker(cfg, run_dir, say)) if is_main else None

    def _tracked(self, action):
        """action() -> its result; on any failure of the tracker, one warning and no tracker from then on."""
        try:
            return action()
        except Exception as e:
            problem = redact(
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
            self.say(
                f"warning: mlflow failed ({problem[:240]}); training continues without it, metrics.jsonl "
                f"keeps every step"
            )
            self.tracker = None
            return None

    def write(self, record: dict) -> None:
        with self.lock:  # the stall watchdog's alert comes from its own thread
            if self.metrics:
                self.metrics.write(record)
            if self.tracker:
                self._tracked(lambda: self.tracker.write(record))
        if self.alerts is not None:  # the events in it (budget, spikes, throughput) reach a person
            self.alerts.observe(record)

    def close(self, reason: str) -> None:
        """`reason`: why the run ended (train/stopping.py's exit reasons)."""
        with self.lock:
            self._close(reason)

    def _close(self, reason: str) -> None:
        if self.metrics:
            self.metrics.close()
        if self.tracker:
            status = {
                "finished": "FINISHED",
                "budget_stop": "KILLED",
                "budget_halt": "KILLED",
                "signal": "KILLED",
                "time_limit": "KILLED",  # stopped on purpose, like a signal (and maybe requeued)
                "throughput_stop": "KILLED",
            }
            self._tracked(lambda: self.tracker.close(status.get(reason, "FAILED")))
        self.metrics = self.tracker = None  # a late write (another thread's) is then a no-op


def open_tracker(cfg: Config, run_dir: Path, say) -> MlflowLogger | None:
    """mlflow when enabled and installed; None (metrics.jsonl only) otherwise."""
    if not cfg.mlflow.enabled:
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        say("note: mlflow is not installed (pip install -e '.[track]'); metrics go to metrics.jsonl only")
        return None
    if lost_secret(cfg.mlflow.uri):
        say(
            f"warning: mlflow.uri = {cfg.mlflow.uri}: its credentials are never saved, and this launch was "
            f"not given them; pass --mlflow.uri again to track it (metrics.jsonl keeps every step)"
        )
        return None
    return MlflowLogger(run_dir, cfg.mlflow.uri, cfg.mlflow.experiment, flatten(cfg), config_text(cfg))
