"""SLURM's variables with values that mean nothing: said at the start, not silently ignored (a garbage
SLURM_JOB_END_TIME left the time-limit stop off without a word)."""

from pretrainer.train.slurm import SlurmJob


def test_garbage_slurm_variables_are_warned_about(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue to ask instead
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_END_TIME": "abc", "SLURM_RESTART_COUNT": "-x"}
    job = SlurmJob.from_env(env)
    assert (job.end_time, job.restart_count) == (None, 0)
    end, restarts = job.warnings
    assert "SLURM_JOB_END_TIME = 'abc' is not epoch seconds" in end and "stop_margin_s cannot act" in end
    assert "SLURM_RESTART_COUNT = '-x' is not a count" in restarts
    good = SlurmJob.from_env({"SLURM_JOB_ID": "42", "SLURM_JOB_END_TIME": "1900000000"})
    assert good.end_time == 1900000000 and good.warnings == ()
