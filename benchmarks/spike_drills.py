"""The spike drills on a tiny model: an LR spike (x100 for 3 batches) at step 120 of 200
under rollback (checkpoints every 20), the same at step 80 of 100 under skip, and the clean run.

    python benchmarks/spike_drills.py OUT_DIR DATA_DIR      # prints final val loss, rollbacks, skips per run
"""

import json
import shutil
import sys
from pathlib import Path

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import load_config
from pretrainer.train.loop import train

out = Path(sys.argv[1])
data = sys.argv[2]
base = {
    "data.dir": data,
    "model.d_model": 64,
    "model.n_layer": 2,
    "model.n_head": 4,
    "model.n_kv_head": 2,
    "model.seq_len": 64,
    "train.micro_batch": 16,
    "optim.lr": 1e-2,
    "optim.warmup_steps": 5,
    "eval.batches": 8,
    "log.every": 1,
    "track.backends": "none",
    "spike.window": 32,
    "spike.min_values": 16,
}
runs = {
    "clean200": {"train.max_steps": 200, "ckpt.every": 20, "eval.every": 200},
    "rollback_lr": {
        "train.max_steps": 200,
        "ckpt.every": 20,
        "eval.every": 200,
        "spike.inject_at_step": 120,
        "spike.inject_kind": "lr",
        "spike.inject_batches": 3,
        "spike.action": "rollback",
    },
    "skip_lr": {
        "train.max_steps": 100,
        "ckpt.every": 20,
        "eval.every": 100,
        "spike.inject_at_step": 80,
        "spike.inject_kind": "lr",
        "spike.inject_batches": 3,
        "spike.action": "skip",
    },
}
res = {}
for name, extra in runs.items():
    run = out / name
    shutil.rmtree(run, ignore_errors=True)
    train(load_config(None, [f"--{k}={v}" for k, v in {**base, **extra, "run.dir": run}.items()]))
    recs = read_metrics(run / "metrics.jsonl")
    res[name] = {
        "final_val": [r["val_loss"] for r in recs if "val_loss" in r][-1],
        "rollbacks": [(r["step"], r["to_step"]) for r in recs if r.get("rollback")],
        "skipped": sum(1 for r in recs if r.get("skipped")),
        "loss83": next((r["loss"] for r in recs if r.get("step") == 83 and "loss" in r), None),
        "loss100": next((r["loss"] for r in recs if r.get("step") == 100 and "loss" in r), None),
        "last_update_to_param": [r.get("update_to_param") for r in recs if "loss" in r][-1],
    }
print(json.dumps(res, indent=1))
