"""Where metrics go: metrics.jsonl always (one JSON object per logged step, validation pass or
event, appended and flushed), and mlflow when it is installed and enabled. The loop writes to one
`RunLog`, which is both (and nothing on ranks other than 0).

On resume the file is first cut back to the checkpoint's step (records of steps after it were
written by the interrupted run and will be recomputed), so every step appears exactly once.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from pretrainer.config import Config, config_text, flatten
from pretrainer.errors import UserError
from pretrainer.flops import mfu
from pretrainer.io import atomic_write_bytes


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
                raise UserError(f"{path}:{number}: not valid JSON in the middle of the file; the metrics are damaged") from None
            if note is not None:
                note(f"note: {path}:{number}: ignoring a torn last line (the process was killed mid-write)")
    return records


class MetricsLog:
    def __init__(self, path: Path, keep_through_step: int):
        """keep_through_step: the resumed checkpoint's step; -1 on a fresh start (an attempt killed before
        its first checkpoint leaves nothing behind)."""
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path, note=print) if r.get("step", 0) <= keep_through_step]
        if self.path.exists() or kept:
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        # non-finite values stay numbers (NaN, Infinity: Python's JSON reads them back as floats), so a
        # divergence is in the data, not a string next to it
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class MlflowLogger:
    """The same records to mlflow, through MlflowClient (no global mlflow state). The default store
    is sqlite inside the run dir; a resumed run continues the same mlflow run (its id is kept in
    RUN_DIR/mlflow-run-id.txt). View with: mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db"""

    def __init__(self, run_dir: Path, uri: str, experiment: str, params: dict[str, object], config_text: str):
        import logging

        from mlflow.tracking import MlflowClient  # importing mlflow configures its loggers: quieten them after

        for name in ("mlflow", "alembic"):  # their INFO lines (database migrations) would land mid-output
            logging.getLogger(name).setLevel(logging.WARNING)

        run_dir = Path(run_dir).resolve()
        self.uri = uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=(run_dir / "mlflow-artifacts").as_uri() if not uri else None)
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
        metrics = [Metric(k, float(v), now_ms, step) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class RunLog:
    """metrics.jsonl (cut back to `keep_through_step` on resume) and mlflow, on rank 0; a no-op elsewhere."""

    def __init__(self, cfg: Config, run_dir: Path, keep_through_step: int, is_main: bool, say):
        if is_main:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", keep_through_step) if is_main else None
        self.tracker = open_tracker(cfg, run_dir, say) if is_main else None

    def write(self, record: dict) -> None:
        for sink in (self.metrics, self.tracker):
            if sink:
                sink.write(record)

    def close(self, reason: str) -> None:
        """`reason`: why the run ended (train/stopping.py's exit reasons)."""
        if self.metrics:
            self.metrics.close()
        if self.tracker:
            status = {"finished": "FINISHED", "budget_stop": "KILLED", "budget_halt": "KILLED", "signal": "KILLED"}
            self.tracker.close(status.get(reason, "FAILED"))


def open_tracker(cfg: Config, run_dir: Path, say) -> MlflowLogger | None:
    """mlflow when enabled and installed; None (metrics.jsonl only) otherwise."""
    if not cfg.mlflow.enabled:
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        say("note: mlflow is not installed (pip install -e '.[track]'); metrics go to metrics.jsonl only")
        return None
    return MlflowLogger(run_dir, cfg.mlflow.uri, cfg.mlflow.experiment, flatten(cfg), config_text(cfg))


# --- the console ---

def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_line(record: dict, end_step: int, tokens_per_step: int) -> str:
    """One logged step in one line that reads well in a file: step/total, loss, lr, grad norm, tok/s,
    MFU and $ when known, and the time left at the current speed."""
    parts = [f"step {record['step']}/{end_step}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad norm {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "spent_usd" in record:
        parts.append(f"${record['spent_usd']:,.2f}")
    if record["tokens_per_s"] > 0:
        parts.append(f"ETA {format_duration((end_step - record['step']) * tokens_per_step / record['tokens_per_s'])}")
    return " | ".join(parts)


# --- quantities the loop logs ---

def l2_norm(tensors) -> torch.Tensor:
    """Global L2 norm of several tensors; FSDP2 shards (DTensors) are reduced across ranks."""
    total = sum(t.detach().float().pow(2).sum() for t in tensors)
    return (total.full_tensor() if hasattr(total, "full_tensor") else total).sqrt()


def parameter_norm(model) -> torch.Tensor:
    return l2_norm(model.parameters())


def weight_norms(model, update_norm: torch.Tensor) -> dict[str, float]:
    """The parameter norm and the update's size relative to it (`update_norm`: ||delta theta|| of the
    step, see optim.adamw_update_norm). Collectives under FSDP2: every rank calls it."""
    param_norm, update = torch.stack([parameter_norm(model), update_norm.to(torch.float32)]).tolist()
    return {"param_norm": param_norm, "update_to_param": update / max(param_norm, 1e-12)}


def layer_group_grad_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradient norm per group (embeddings, each block, final norm): where a spike's gradient lives."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        group = "embeddings" if name.startswith(("wte", "wpe")) else ".".join(name.split(".")[:2]) if name.startswith("layers.") else "final"
        groups.setdefault(group, []).append(p.grad)
    return {group: l2_norm(grads) for group, grads in groups.items()}


class Throughput:
    """Tokens per second (and MFU, when the device's peak is known) over the interval since the last
    reading, not counting evaluation and checkpoint time (restart() after them)."""

    def __init__(self, tokens: int, flops_per_token: float, peak_tflops: float | None, world_size: int):
        self.started, self.tokens = time.time(), tokens
        self.flops_per_token, self.peak_tflops, self.world_size = flops_per_token, peak_tflops, world_size

    def restart(self) -> None:
        self.started = time.time()

    def interval_s(self) -> float:
        """Seconds since the interval began (read before rate(), which starts the next one)."""
        return time.time() - self.started

    def rate(self, tokens: int) -> dict[str, float]:
        now = time.time()
        tokens_per_s = (tokens - self.tokens) / max(now - self.started, 1e-9)
        self.started, self.tokens = now, tokens
        if not self.peak_tflops:
            return {"tokens_per_s": tokens_per_s}
        return {"tokens_per_s": tokens_per_s, "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_tflops, self.world_size)}


def hardware_info(device: torch.device, world_size: int) -> dict:
    info = {"device_type": device.type, "world_size": world_size, "cpu_count": os.cpu_count(),
            "cpu_model": platform.processor() or platform.machine()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = world_size
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 1e9, 1)
    return info
