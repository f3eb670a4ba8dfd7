import pytest
import torch
from support.report_helpers import modes, umask

from pretrainer.analysis.report.plots import throughput_series, time_unit, write_plots
from pretrainer.artifacts.checkpoint import save_checkpoint


@pytest.mark.parametrize("duration_s, unit", [(30, "seconds"), (30 * 60, "minutes"), (5 * 3600, "hours")])
def test_time_axis_unit_fits_the_run(duration_s, unit):
    name, seconds_per_unit = time_unit(duration_s)
    assert name == unit and 1 <= duration_s / seconds_per_unit <= 120


def test_plots_include_the_learning_rate_and_a_fitting_time_axis(tmp_path):
    records = [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "lr": 1e-3 * min(1, s / 5),
            "grad_norm": 1.0,
            "param_norm": 10.0,
            "tokens_per_s": 1000.0,
            "elapsed_s": 1.5 * s,
        }
        for s in range(1, 21)
    ]
    written = write_plots(records, tmp_path, title="synthetic")
    assert "lr.png" in written and all((tmp_path / name).is_file() for name in written)
    (times, _), label = throughput_series(records)
    assert label == "wall-clock seconds" and max(times) == 30.0  # a 30-second run, not 0.008 hours


def test_export_of_a_non_run_is_a_clear_error(tmp_path, run_cli):
    code, _, err = run_cli("export", tmp_path, "--out", tmp_path / "report")
    assert code == 2 and "no complete checkpoint" in err and not (tmp_path / "report").exists()


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_checkpoint_files_get_the_umask_mode(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        save_checkpoint(tmp_path, 1, {"w": torch.ones(3)}, {"state": {}}, {"step": 1}, keep=1)
    found = modes(tmp_path)
    assert "checkpoints/step-0000001/model.safetensors" in found  # safetensors wrote it 0600 before
    assert found == {name: dir_mode if (tmp_path / name).is_dir() else file_mode for name in found}
