"""ckpt.every = auto: the Young/Daly interval, and when the trainer's cadence writes."""

import math

import numpy as np
import pytest
import torch

from pretrainer.config.load import load_config
from pretrainer.core.errors import UserError
from pretrainer.train.cadence import (
    AUTO,
    CheckpointCadence,
    preemption_cost,
    young_daly_seconds,
    young_daly_steps,
)
from pretrainer.train.distributed import DistEnv

ONE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("write_s, per_hour", [(4.0, 0.25), (60.0, 0.05), (0.5, 2.0)])
def test_the_interval_is_the_one_that_wastes_least(write_s, per_hour):
    """Young's first-order waste per unit of time: write/T for the checkpoints, T/(2 x MTBI) for the half
    interval an interruption loses; the formula's T is its minimum (a grid around it agrees to 0.5%)."""
    mtbi = 3600 / per_hour
    waste = lambda t: write_s / t + t / (2 * mtbi)  # noqa: E731
    grid = np.geomspace(1.0, 100 * mtbi, 200_000)
    best = grid[np.argmin(waste(grid))]
    assert young_daly_seconds(write_s, per_hour) == pytest.approx(best, rel=5e-3)
    assert young_daly_seconds(write_s, per_hour) == pytest.approx(math.sqrt(2 * write_s * mtbi))


def test_the_interval_in_steps_rounds_and_never_reaches_zero():
    assert young_daly_steps(4.0, 0.5, 0.25) == round(math.sqrt(2 * 4.0 * 14400) / 0.5)
    assert young_daly_steps(1e-6, 100.0, 100.0) == 1


def test_expected_preemption_loss_is_half_an_interval_and_a_start_up_each():
    cost = preemption_cost(
        wall_s=36_000, every_steps=100, step_s=2.0, write_s=5.0, startup_s=120, per_hour=0.5
    )
    assert cost["interruptions"] == pytest.approx(5.0)
    assert cost["lost_s"] == pytest.approx(5.0 * (100 * 2.0 / 2 + 120))


def test_a_fixed_cadence_writes_at_multiples_only():
    cadence = CheckpointCadence(50, 0.0, 1, env=ONE_PROCESS, log=lambda record: None)
    assert [step for step in range(1, 201) if cadence.due(step)] == [50, 100, 150, 200]
    assert not any(
        CheckpointCadence(0, 0.0, 1, env=ONE_PROCESS, log=lambda r: None).due(s) for s in range(1, 100)
    )


def test_auto_writes_once_the_step_time_is_measured_then_at_the_measured_interval():
    records = []
    cadence = CheckpointCadence(AUTO, 0.5, 1, env=ONE_PROCESS, log=records.append)
    assert not cadence.due(5)  # nothing measured yet
    cadence.measured_step(0.25)
    assert cadence.due(10)  # the first logging step: the write is measured there
    cadence.checkpointed(10, write_s=2.0)
    expected = young_daly_steps(2.0, 0.25, 0.5)
    assert [s for s in range(11, 11 + 2 * expected) if cadence.due(s)][0] == 10 + expected
    assert records == [
        {
            "step": 10,
            "ckpt_every": expected,
            "ckpt_write_s": 2.0,
            "ckpt_step_s": 0.25,
            "interruptions_per_hour": 0.5,
        }
    ]
    cadence.checkpointed(10 + expected, write_s=2.0)  # the same interval again: nothing new to log
    assert len(records) == 1


def test_auto_is_read_from_toml_and_cli_and_needs_a_declared_rate(tmp_path):
    assert load_config(None, ["--ckpt.every=auto", "--ckpt.interruptions_per_hour=0.1"]).ckpt.every == AUTO
    config = tmp_path / "c.toml"
    config.write_text('[ckpt]\nevery = "auto"\ninterruptions_per_hour = 0.2\n')
    assert load_config(config, []).ckpt.every == AUTO
    with pytest.raises(UserError, match="interruptions_per_hour"):
        load_config(None, ["--ckpt.every=auto"])


def test_auto_under_keep_best_checkpoints_where_a_validation_ran():
    cadence = CheckpointCadence(AUTO, 100.0, 1, env=ONE_PROCESS, log=lambda record: None, align=20)
    cadence.measured_step(0.1)
    assert not cadence.due(10) and cadence.due(20)  # the first one waits for a validated step
    cadence.checkpointed(20, write_s=0.01)  # a 1-2 step interval, rounded up to the next validation
    assert [s for s in range(21, 61) if cadence.due(s)][0] == 40
    cadence.measured_step(-5.0)  # a negative rate (tokens rewound by a rollback) is not a step time
    assert cadence.step_s == 0.1
