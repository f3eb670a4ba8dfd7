"""The trainer's components, by name, in the order the trainer calls their hooks (train/component.py
says what a component is). Adding one is its module plus one entry here: a `build(trainer)` that
returns the component, or None when the config leaves it off.

The order matters where one component's work feeds another's: the evaluation runs before the
checkpoint of the same step (--checkpoint best ranks by its val loss), the console's step line before
the speed watchdog's verdict on that step, and the checkpointing closes last (the write in flight
completes once everything else has stopped).
"""

from __future__ import annotations

from pretrainer.train.alerts import Alerts
from pretrainer.train.checkpoint import Checkpointing
from pretrainer.train.console import ProgressBar
from pretrainer.train.evaluation import Evaluation
from pretrainer.train.norms import Norms
from pretrainer.train.perf import SpeedMonitor
from pretrainer.train.profiler import Profiler
from pretrainer.train.run_dir_guard import RunDirGuard
from pretrainer.train.spikes import SpikeGuard
from pretrainer.train.stopping import Stopper
from pretrainer.train.tracking import SequenceLog

REGISTRY = {
    "alerts": Alerts.build,  # first: the others' events become alerts as they are logged
    "run_dir": RunDirGuard.build,  # votes "run_dir_lost": another trainer has the run dir now
    "stopping": Stopper.build,  # signals, time limits, the budget: votes "budget", "signal", "time_limit"
    "spikes": SpikeGuard.build,  # votes "drop_batch"; the flagged steps on logging steps
    "norms": Norms.build,
    "console": ProgressBar.build,
    "speed": SpeedMonitor.build,  # tokens/s, MFU, host syncs; the watchdog votes "slow"
    "sequences": SequenceLog.build,
    "profiler": Profiler.build,
    "evaluation": Evaluation.build,
    "checkpointing": Checkpointing.build,
}


def build_components(trainer) -> list:
    """The run's components, each built from the trainer (its config, state and sinks), appended to
    trainer.components as it is built: if one fails, those before it are still closed."""
    for name, build in REGISTRY.items():
        component = build(trainer)
        if component is not None:
            assert component.name == name, f"{name}'s build made {component.name}"
            trainer.components.append(component)
    return trainer.components
