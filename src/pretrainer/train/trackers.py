"""The trackers a run's numbers go to besides metrics.jsonl (track.backends): mlflow, TensorBoard, W&B.
Each gets the same things with the same step numbers: a logged record's scalars, the run's params once,
and its events (a record's words: an alert and its message) as text. One small interface:

    tracker = Tracker.open(cfg, run_dir, keep_through_step, say)   # None: it cannot run this launch
    tracker.write(record)    a metrics.jsonl record: {"step": 20, "loss": 3.1, ...}
    tracker.close(status)    "FINISHED", "KILLED" (stopped on purpose) or "FAILED" (core/end_reasons.py)
    tracker.rewinds          whether logging a step again replaces it (see RunLog's resume)

Each is imported only when asked for; RunLog (train/tracking.py) reports one that fails and goes on.
A new tracker is one class with that interface (its `package` and `install` hint too) and one entry
in TRACKERS below; config/schema.py's TRACKERS names the same ones (a test keeps them equal).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from pathlib import Path

from pretrainer.config.keys import config_text, flatten
from pretrainer.core.files import atomic_write_bytes
from pretrainer.core.secrets import lost_secret, reveal


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers (not the step; booleans and non-finite values stay in metrics.jsonl)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def words(record: dict) -> dict[str, str]:
    """A record's text fields: an event (`alert` and its `message`)."""
    return {k: v for k, v in record.items() if isinstance(v, str)}


def run_id_file(run_dir: Path, backend: str) -> tuple[Path, str]:
    """RUN_DIR/<backend>-run-id.txt and the id it holds ("" before the first launch): a resumed run
    continues the tracker's run instead of starting another."""
    path = Path(run_dir) / f"{backend}-run-id.txt"
    return path, path.read_text().strip() if path.is_file() else ""


def reachable(uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) tracking server answers a TCP connection within timeout_s, or OSError (the tracker's
    one warning, at once)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise OSError(
            f"cannot connect to {parts.hostname}:{port} ({e.strerror or e}); start the server or fix "
            f"track.mlflow_uri"
        ) from None


class MlflowTracker:
    """Through MlflowClient (no global mlflow state). The default store is sqlite inside the run dir.
    View with: mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db"""

    rewinds = False  # a metric's history keeps every value logged
    package, install = "mlflow", "pip install mlflow"

    @classmethod
    def open(cls, cfg, run_dir: Path, keep_through_step: int, say) -> MlflowTracker | None:
        if lost_secret(cfg.track.mlflow_uri):
            say(
                f"warning: track.mlflow_uri = {cfg.track.mlflow_uri}: its credentials are never saved, and "
                f"this launch was not given them; pass --track.mlflow_uri again to track it (metrics.jsonl "
                f"keeps every step)"
            )
            return None
        return cls(run_dir, cfg.track.mlflow_uri, cfg.track.experiment, flatten(cfg), config_text(cfg))

    def __init__(self, run_dir: Path, uri: str, experiment: str, params: dict[str, object], config_text: str):
        import logging

        # importing mlflow configures its loggers: quieten them after
        from mlflow.tracking import MlflowClient

        # their INFO lines (database migrations) would land mid-output, and their ERROR tracebacks: RunLog
        # reports a failing store in one line
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

        run_dir = Path(run_dir).resolve()
        self.events = int(time.time() * 1000)  # event tags' names stay unique across launches
        self.uri = uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        reachable(reveal(self.uri))  # before mlflow's 7 retries with backoff (257 s on a closed port)
        self.client = MlflowClient(tracking_uri=reveal(self.uri))  # the one place credentials are used
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found
            else self.client.create_experiment(
                experiment, artifact_location=(run_dir / "mlflow-artifacts").as_uri() if not uri else None
            )
        )
        id_file, self.run_id = run_id_file(run_dir, "mlflow")
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])
            self.client.log_text(self.run_id, config_text, "config.toml")
            atomic_write_bytes(id_file, (self.run_id + "\n").encode())

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric, RunTag

        step, now_ms = int(record.get("step", 0)), int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, step) for k, v in scalars(record).items()]
        self.events += bool(words(record))  # two events at one step: two tags
        tags = [RunTag(f"event.{self.events}.step{step}.{k}", v[:5000]) for k, v in words(record).items()]
        if metrics or tags:
            self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard (torch's SummaryWriter). View with:
    tensorboard --logdir RUN_DIR/tensorboard"""

    rewinds = True  # purge_step: the reader hides an earlier process's events from that step on
    package, install = "tensorboard", "pip install tensorboard"

    @classmethod
    def open(cls, cfg, run_dir: Path, keep_through_step: int, say) -> TensorBoardTracker:
        return cls(run_dir, keep_through_step, config_text(cfg))

    def __init__(self, run_dir: Path, keep_through_step: int, config_text: str):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run logs again the steps after its checkpoint; on a fresh start (-1), everything an
        # attempt killed before its first checkpoint wrote is hidden
        self.writer = SummaryWriter(
            str(Path(run_dir) / "tensorboard"), purge_step=keep_through_step + 1, flush_secs=30
        )
        if keep_through_step < 0:  # the config once, as a code block (TensorBoard renders markdown)
            self.writer.add_text("config", "".join(f"    {line}\n" for line in config_text.splitlines()), 0)

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        for key, value in words(record).items():
            self.writer.add_text(f"events/{key}", value, step)

    def close(self, status: str = "FINISHED") -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run. Online it needs `wandb login` (or $WANDB_API_KEY); with $WANDB_MODE=offline it writes
    RUN_DIR/wandb/offline-run-*, one per launch, which `wandb sync RUN_DIR/wandb` uploads as one run
    (the same id). $WANDB_ENTITY picks the team."""

    rewinds = False  # W&B keeps a step's first values; its steps only go forward
    package, install = "wandb", "pip install wandb"

    @classmethod
    def open(cls, cfg, run_dir: Path, keep_through_step: int, say) -> WandbTracker:
        return cls(run_dir, cfg.track.experiment, flatten(cfg))

    def __init__(self, run_dir: Path, experiment: str, params: dict[str, object]):
        import wandb

        run_dir = Path(run_dir).resolve()
        id_file, run_id = run_id_file(run_dir, "wandb")
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
        # W&B names an offline run's directory by its start second: a launch within a second of the last
        # one would write into that one's
        started = [p.stat().st_mtime for p in (run_dir / "wandb").glob("offline-run-*")]
        if offline and started and time.time() - max(started) < 1.1:
            time.sleep(1.1 - (time.time() - max(started)))
        if not offline and not wandb.login(prompt=False, verify=False):  # a terminal would wait on a prompt
            raise RuntimeError("not logged in to W&B: wandb login, WANDB_API_KEY, or WANDB_MODE=offline")
        self.run = wandb.init(
            project=experiment,
            id=run_id or secrets.token_hex(8),  # W&B's ids: lowercase letters and digits
            resume="allow",
            name=run_dir.name,
            dir=str(run_dir),
            config=params,
            # the run's console is its own (train/console.py); no sampling thread or code upload; no
            # metadata: it would hold the command line (a credential given as --key=VALUE) and git remotes
            settings=wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                x_disable_meta=True,
                disable_git=True,
                save_code=False,
                x_save_requirements=False,
            ),
        )
        if not run_id:
            atomic_write_bytes(id_file, (self.run.id + "\n").encode())

    def write(self, record: dict) -> None:
        self.run.log({**scalars(record), **words(record)}, step=int(record.get("step", 0)))

    def close(self, status: str = "FINISHED") -> None:
        if status == "KILLED":  # stopped on purpose (a signal, the budget): a resume continues it
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


# track.backends' names -> their trackers
TRACKERS = {"mlflow": MlflowTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker}
