"""Each tracker's steps, read back the way its own tools read them: mlflow's client, TensorBoard's
EventAccumulator (which applies purge_step), and W&B's offline transaction log decoded with W&B's own
protobuf schema."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def mlflow_history(run_dir: Path, key: str) -> dict[int, list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}")
    run_id = (Path(run_dir) / "mlflow-run-id.txt").read_text().strip()
    out: dict[int, list[float]] = {}
    for metric in client.get_metric_history(run_id, key):
        out.setdefault(metric.step, []).append(metric.value)
    return out


def tensorboard_history(run_dir: Path, key: str) -> dict[int, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    events.Reload()
    out: dict[int, list[float]] = {}
    for scalar in events.Scalars(key):
        out.setdefault(scalar.step, []).append(scalar.value)
    return out


def wandb_records(path: Path):
    """The records of one .wandb file: a 7-byte W&B header (":W&B", 0xBEE1, version), then LevelDB's log
    format (32 KiB blocks of chunks, each with a 7-byte header: crc32c, length, type). W&B's Python reader
    went with its move to wandb-core; the records are decoded with its protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = 32768 - position % 32768
        if left_in_block < 7:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:  # zeroes: preallocated, never written
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: Path, key: str) -> dict[int, list[float]]:
    """Every offline launch's history rows (one file per launch, all with the run's id), in order."""
    run_id = (Path(run_dir) / "wandb-run-id.txt").read_text().strip()
    out: dict[int, list[float]] = {}
    for path in sorted((Path(run_dir) / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            if key in items:
                out.setdefault(int(items["_step"]), []).append(items[key])
    return out
