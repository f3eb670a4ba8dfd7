"""The example job scripts (examples/slurm/) on a real SLURM: a one-node cluster started for the session
(the `slurm` fixture), a tiny model on CPU (gloo), each script as shipped, only the GPU request lifted on
the sbatch command line (--gpus=0 overrides the script's #SBATCH --gpus=1) and --train.device=cpu added.

Drills: USR1 to the batch shell -> checkpoint, requeue, the job runs again (SLURM_RESTART_COUNT=1) and
finishes with the losses of a run straight through (script a); the 2-node script as two tasks of one
node, USR1 to every worker -> the same, with the 2-rank losses (script c); a plain scancel (SIGTERM) ->
checkpoint, exit 143, no requeue; a budget stop -> exit 4, no requeue. (Script b, the --nproc launcher,
is left to test_cluster's signal tests: each SLURM drill here costs seconds of the suite's time.)

A job spends most of its time starting Python and waiting for SLURM (a requeued job waits ~7 s for its
credential to expire), little training. So the module starts every selected drill at once: each is a
generator, all stepped by one loop (no threads: the references are forked processes), and each test
waits for its own. The requeue drills go first; the others start once the requeue drills have sent
their signal, and run while SLURM holds the requeued jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import DOCS, _child, _cli_train, exit_hook, exit_hook_calls, fork_train, losses, rank_envs
from support.slurm_cluster import FINAL_STATES as FINAL
from support.slurm_cluster import SlurmCluster

import pretrainer
from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.toml_text import toml_document

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "slurm"
STEPS = 30  # ~25 ms a step: the signal (sent once step SIGNAL_AT is logged) lands mid-run
SIGNAL_AT = 2
SETTINGS = {  # helpers.tiny_overrides' model, as the TOML config file a job script is given
    "model": {"d_model": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "seq_len": 64},
    "train": {"micro_batch": 8, "max_steps": STEPS},
    "optim": {"lr": 3e-3, "warmup_steps": 5},
    "eval": {"every": 0, "batches": 4},
    "ckpt": {"every": 1000},
    "log": {"every": 1},
    "track": {"backends": []},
}
CPU = "--train.device=cpu"
PYTHONPATH = os.pathsep.join([str(Path(pretrainer.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
# what a job's processes import: the trainer, torch.compile's machinery (imported on first use), torchrun
JOB_IMPORTS = ("pretrainer.cli.main", "pretrainer.train.loop", "torch._dynamo", "torch.distributed.run")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@dataclass
class Job:
    """One submitted job script: its id, run dir and output file."""

    id: int
    run: Path
    out: Path


@dataclass
class Drills:
    """The drills in flight, each a generator that yields while it waits; result(name) steps them all
    (every 0.1 s) until that one returns, and re-raises what it raised. One `scontrol show job` per step
    serves every drill."""

    cluster: SlurmCluster
    root: Path
    config: Path
    pending: dict[str, Generator] = field(default_factory=dict)
    done: dict[str, tuple] = field(default_factory=dict)
    snapshot: dict = field(default_factory=dict)
    references: dict[str, tuple[Path, list]] = field(default_factory=dict)  # name -> run dir, processes
    leading: set[str] = field(default_factory=set)  # requeue drills that have not sent their signal yet
    bytecode: dict = field(default_factory=dict)  # the jobs' bytecode cache (see warm_bytecode)
    warming: subprocess.Popen | None = None

    def submit(self, script: str, name: str, *sbatch: str, env: dict | None = None, args=()) -> Job:
        """sbatch [options] examples/slurm/SCRIPT --train.device=cpu ARGS, with CONFIG and RUN_DIR set, this
        interpreter's pretrainer on PATH and PYTHONPATH, and one thread per process (what the forked
        references train with)."""
        run, out = self.root / name, self.root / f"{name}.out"
        job_env = {
            "CONFIG": str(self.config),
            "RUN_DIR": str(run),
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": PYTHONPATH,
            **self.bytecode,
            **(env or {}),
        }
        job_id = self.cluster.sbatch(
            f"--chdir={self.root}",
            f"--output={out}",
            f"--job-name={name}",
            "--cpus-per-task=1",
            *sbatch,
            EXAMPLES / script,
            CPU,
            f"--run.on_exit={exit_hook(self.root / f'{name}.hook')}",  # must run once, never on the requeue
            *args,
            env=job_env,
        )
        return Job(job_id, run, out)

    def job(self, job: Job) -> dict[str, str]:
        return self.snapshot.get(job.id) or self.cluster.job(job.id)

    def start(self, name: str, drill: Generator, lead: bool = False) -> None:
        self.pending[name] = drill
        if lead:
            self.leading.add(name)

    def after_leads(self) -> Generator:
        """Wait until every requeue drill has sent its signal: they go first, since SLURM holds a requeued
        job ~7 s whatever the load, and the other drills' jobs run in that time."""
        yield from until(lambda: not self.leading, 120, "the requeue drills' signals")

    def start_reference(self, name: str) -> None:
        """Fork the run straight through that drill `name` compares with (once)."""
        if name not in self.references:
            nproc = {"one_rank": 1, "two_ranks": 2}[name]
            run = self.root / f"reference-{nproc}"
            self.references[name] = (run, fork_reference(self.config, run, nproc))

    def warm_bytecode(self) -> None:
        """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, as in many containers), every job
        process would compile torch's sources afresh (~4 s of CPU each, the most of a tiny job's cost):
        the jobs get a bytecode cache of their own (PYTHONPYCACHEPREFIX, outside the venv), filled by one
        process before the first job starts."""
        if not sys.flags.dont_write_bytecode:
            return
        self.bytecode = {"PYTHONPYCACHEPREFIX": str(self.root / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
        self.warming = subprocess.Popen(
            [sys.executable, "-c", f"import {', '.join(JOB_IMPORTS)}"],
            env={**os.environ, "PYTHONPATH": PYTHONPATH, **self.bytecode},
        )

    def result(self, name: str):
        while name not in self.done:
            if self.warming is not None and self.warming.poll() is None:
                time.sleep(0.1)
                continue
            self.snapshot = self.cluster.jobs()
            for key, drill in list(self.pending.items()):
                try:
                    next(drill)
                except StopIteration as stop:
                    self.done[key] = (stop.value, None)
                except Exception as e:  # noqa: BLE001 (the drill's test re-raises it)
                    self.done[key] = (None, e)
                if key in self.done:
                    del self.pending[key]
                    self.leading.discard(key)
            if name not in self.done:
                time.sleep(0.1)
        value, error = self.done[name]
        if error is not None:
            raise error
        return value

    def reference(self, name: str) -> Path:
        """The run dir of a reference run straight through, once its processes have finished."""
        run, procs = self.references[name]
        for proc in procs:
            proc.join(180)
            assert proc.exitcode == 0, f"reference {name}: exit {proc.exitcode}\n" + "".join(
                log.read_text()[-2000:] for log in sorted(run.parent.glob(f"{run.name}*.log"))
            )
        return run


def until(check: Callable, timeout: float, what: str) -> Generator:
    """Yield until check() is true -> its value; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        yield
    return value


def logged_step(run: Path) -> int:
    if not (run / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r), default=0)


def wait_for_step(drills: Drills, job: Job, step: int) -> Generator:
    """Until the job's run has logged `step` (AssertionError, with its output, if the job ends first)."""

    def reached() -> bool:
        if drills.job(job).get("JobState") in FINAL:
            raise AssertionError(f"job {job.id} ended before step {step}: {job.out.read_text()[-3000:]}")
        return logged_step(job.run) >= step

    yield from until(reached, 120, f"job {job.id}: step {step}")


def wait_final(drills: Drills, job: Job, check: Callable = lambda fields: True) -> Generator:
    """Until the job is over (every process gone: COMPLETING is not final) and check(fields) -> fields."""

    def over() -> dict | None:
        fields = drills.job(job)
        return fields if fields.get("JobState") in FINAL and check(fields) else None

    return (yield from until(over, 120, f"job {job.id}: the end"))


def exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())


def output(job: Job) -> str:
    return job.out.read_text(errors="replace") if job.out.exists() else ""


# the drills: each submits one job, drives it, and returns what its test checks
def requeue_drill(drills: Drills, name: str, script: str, *sbatch: str, env=None, to="--batch"):
    """USR1 once the run has trained a few steps: to the batch shell (to="--batch": what
    --signal=B:USR1@180 sends) or to every process of the job's steps (to="": --signal=USR1@180); then
    the requeued job runs again and finishes."""
    job = drills.submit(script, name, *sbatch, env=env)
    try:
        yield from wait_for_step(drills, job, SIGNAL_AT)
        drills.cluster.scancel(job.id, "--signal=USR1", *([to] if to else []))
    finally:
        drills.leading.discard(name)
    requeued = yield from until(
        lambda: drills.job(job).get("Restarts") == "1" or drills.job(job).get("JobState") in FINAL,
        60,
        f"job {job.id}: requeued",
    )
    assert drills.job(job).get("Restarts") == "1", f"not requeued: {requeued}\n{output(job)[-3000:]}"
    stopped = exit_record(job.run)  # the first run's, before the second overwrites it
    final = yield from wait_final(drills, job)
    return job, stopped, final


def scancel_drill(drills: Drills, name: str) -> Generator:
    """Script (a); a plain scancel (SIGTERM to every process of the job) mid-run."""
    yield from drills.after_leads()
    job = drills.submit("train-1gpu.sbatch", name, "--gpus=0")
    yield from wait_for_step(drills, job, SIGNAL_AT)
    drills.cluster.scancel(job.id)
    final = yield from wait_final(drills, job)
    return job, final


def budget_drill(drills: Drills, name: str) -> Generator:
    """Script (a) with a budget the run will overspend: budget.json (kept by a sidecar in real use) says
    $0.50 spent and $2 projected, against a $1 cap: the first check stops the run."""
    yield from drills.after_leads()
    budget = drills.root / "budget.json"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    spend = {"spent_usd": 0.5, "rate_usd_per_hr": 1.0, "hours_elapsed": 0.5, "projected_total_usd": 2.0}
    budget.write_text(json.dumps({**spend, "last_update_utc": now}))
    caps = ["--budget.cap_usd=1", "--budget.usd_per_gpu_hour=1", f"--budget.file={budget}"]
    job = drills.submit("train-1gpu.sbatch", name, "--gpus=0", args=caps)
    final = yield from wait_final(drills, job)
    return job, final


def prepare_array_drill(drills: Drills, name: str, tokenizer: Path) -> Generator:
    """The prepare script as a 3-task job array (a part each, two at a time on this node's two CPUs) and the
    merge job after it (--dependency=afterok): -> (the array's tasks, the merge job's fields, OUT, corpus).
    It starts once the requeue drills are over: its jobs would hold the node's CPUs their requeued jobs wait
    for."""
    leads = [drill.name for drill in DRILLS.values() if drill.lead]
    yield from until(lambda: not any(lead in drills.pending for lead in leads), 240, "the requeue drills")
    corpus, out = drills.root / "corpus.jsonl", drills.root / "prepared"
    lines = (
        json.dumps({"text": f"# {i}\n" + "".join(DOCS[(i + j) % len(DOCS)] for j in range(24))})
        for i in range(7000)
    )
    corpus.write_text("\n".join(lines) + "\n")  # ~10 MB: 3 units of at least 4 MiB (MIN_UNIT_BYTES)
    env = {
        "CORPUS": str(corpus),
        "OUT": str(out),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": PYTHONPATH,
        **drills.bytecode,
    }
    args = ("--tokenizer-from", tokenizer, "--val-fraction", "0.05")
    script = EXAMPLES / "prepare-array.sbatch"
    common = (f"--chdir={drills.root}", f"--job-name={name}", "--cpus-per-task=1")
    parts = drills.cluster.sbatch(
        *common, "--array=1-3", f"--output={drills.root}/{name}-%a.out", script, *args, env=env
    )
    merge = drills.cluster.sbatch(
        *common,
        f"--dependency=afterok:{parts}",
        f"--output={drills.root}/{name}-merge.out",
        script,
        *args,
        env=env,
    )

    def tasks() -> list[dict]:
        return [
            f
            for f in drills.snapshot.values()
            if f.get("ArrayJobId") == str(parts) and f.get("ArrayTaskId", "").isdigit()
        ]

    def parts_over() -> bool:
        found = tasks()
        if any(f.get("JobState") in FINAL and f.get("JobState") != "COMPLETED" for f in found):
            logs = "".join(p.read_text()[-2000:] for p in drills.root.glob(f"{name}-*.out"))
            raise AssertionError(f"a part failed: {found}\n{logs}")
        return len(found) == 3 and all(f.get("JobState") == "COMPLETED" for f in found)

    yield from until(parts_over, 120, f"array job {parts}: its 3 parts")
    array = tasks()
    final = yield from wait_final(drills, Job(merge, out, drills.root / f"{name}-merge.out"))
    return array, final, out, corpus


@dataclass
class Drill:
    name: str  # its run dir and job name
    start: Callable  # (drills, name) -> the drill's generator
    lead: bool = False  # a requeue drill: starts first, the others once it has sent its signal
    reference: str = ""  # the run straight through it compares with: "one_rank" or "two_ranks"


TWO_TASKS = ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0")  # the 2-node script's, on one node
DRILLS = {  # test -> its drill
    "test_requeue_drill_resumes_to_the_uninterrupted_losses": Drill(
        "requeue", lambda d, n: requeue_drill(d, n, "train-1gpu.sbatch", "--gpus=0"), True, "one_rank"
    ),
    "test_scancel_checkpoints_exits_143_and_is_not_requeued": Drill("scancel", scancel_drill),
    "test_budget_stop_exits_4_and_is_not_requeued": Drill("budget", budget_drill),
    "test_two_node_script_usr1_to_every_worker_requeues_and_resumes_to_the_two_rank_losses": Drill(
        "two-nodes",
        lambda d, n: requeue_drill(
            d,
            n,
            "train-2nodes.sbatch",
            *TWO_TASKS,
            env={"NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())},
            to="",
        ),
        True,
        "two_ranks",
    ),
    "test_the_prepare_array_script_prepares_three_parts_and_merges_them": Drill(
        "prepare-array", lambda d, n: prepare_array_drill(d, n, d.config.parent / "tokenizer-data")
    ),
}


def fork_reference(config: Path, run: Path, nproc: int) -> list:
    """The run straight through, in `nproc` forked processes (gloo ranks when 2), one thread each."""
    if nproc == 1:
        return [fork_train(str(config), f"--run.dir={run}", CPU, log=run.with_suffix(".log"))]
    import multiprocessing

    port, context, procs = free_port(), multiprocessing.get_context("fork"), []
    for rank, env in enumerate(rank_envs(nproc, port)):
        fd = os.open(run.with_suffix(f".rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        args = ([str(config), f"--run.dir={run}", CPU],)
        procs.append(context.Process(target=_child, args=(fd, env, _cli_train, args)))
        procs[-1].start()
        os.close(fd)
    return procs


@pytest.fixture(scope="module")
def drills(request, slurm, stdlib_data, tmp_path_factory):
    """Every selected test's drill, started together, and the references they need forked beside them."""
    root = tmp_path_factory.mktemp("slurm-drills")
    config = root / "tiny.toml"
    config.write_text(toml_document({"data": {"dir": str(stdlib_data)}, **SETTINGS}))
    runs = Drills(slurm, root, config)
    shutil.copytree(stdlib_data, root / "tokenizer-data")  # the prepare drill's tokenizer (--tokenizer-from)
    runs.warm_bytecode()
    selected = [DRILLS[item.name] for item in request.session.items if item.name in DRILLS]
    for drill in selected:
        runs.start(drill.name, drill.start(runs, drill.name), lead=drill.lead)
        if drill.reference:
            runs.start_reference(drill.reference)
    yield runs
    for proc in (p for _, procs in runs.references.values() for p in procs):
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def stopped_by_usr1_and_requeued(drills: Drills, job: Job, stopped: dict, final: dict, reference: str):
    """The first run: stopped by USR1 with a checkpoint, exit.json "requeued", the job requeued once, and
    every step it logged equal to the run straight through."""
    assert stopped["reason"] == "signal" and stopped.get("requeued") is True, stopped
    assert SIGNAL_AT <= stopped["step"] < STEPS and "USR1" in stopped["message"], stopped
    assert f"SLURM job {job.id} requeued" in output(job), output(job)[-3000:]
    assert final["Restarts"] == "1", final
    straight = losses(drills.reference(reference))
    assert losses(job.run) == {step: straight[step] for step in losses(job.run)} and len(straight) == STEPS


def ran_again_and_finished(job: Job, final: dict) -> None:
    """The second run: SLURM_RESTART_COUNT=1, resumed from the first run's checkpoint and finished (its
    losses: stopped_by_usr1_and_requeued's); --open-mode=append kept the first run's output."""
    log = output(job)
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", f"{final}\n{log[-3000:]}"
    assert "restart 0:" in log and "restart 1:" in log, log[-3000:]
    assert exit_record(job.run)["reason"] == "finished" and len(losses(job.run)) == STEPS
    assert [call[:3] for call in hook_calls(job)] == [("finished", 0, STEPS)]  # not on the requeue


def hook_calls(job: Job) -> list:
    return exit_hook_calls(job.out.with_suffix(".hook"))


def test_requeue_drill_resumes_to_the_uninterrupted_losses(drills):
    """Script (a): the trainer is the batch shell and requeues the job itself."""
    job, stopped, final = drills.result("requeue")
    stopped_by_usr1_and_requeued(drills, job, stopped, final, "one_rank")
    ran_again_and_finished(job, final)


def test_scancel_checkpoints_exits_143_and_is_not_requeued(drills):
    job, final = drills.result("scancel")
    record = exit_record(job.run)
    assert record["reason"] == "signal" and record["exit_code"] == 143 and "SIGTERM" in record["message"]
    assert not record.get("requeued"), record
    checkpoint = latest_checkpoint(job.run)
    assert checkpoint is not None and (checkpoint / "COMPLETE").is_file()
    assert SIGNAL_AT <= int(checkpoint.name.split("-")[1]) == record["step"] < STEPS
    assert final["JobState"] == "CANCELLED" and final["Restarts"] == "0", final
    assert "restart 1:" not in output(job)
    assert [call[:3] for call in hook_calls(job)] == [("signal", 143, record["step"])]


def test_budget_stop_exits_4_and_is_not_requeued(drills):
    job, final = drills.result("budget")
    record = exit_record(job.run)
    assert record["reason"] == "budget_stop" and record["exit_code"] == 4, record
    assert not record.get("requeued"), record
    assert latest_checkpoint(job.run) is not None  # a budget stop checkpoints before it exits
    assert final["JobState"] == "FAILED" and final["ExitCode"] == "4:0" and final["Restarts"] == "0", final
    assert "restart 1:" not in output(job)
    assert [call[:3] for call in hook_calls(job)] == [("budget_stop", 4, record["step"])]


def test_two_node_script_usr1_to_every_worker_requeues_and_resumes_to_the_two_rank_losses(drills):
    """Script (c) on one node: two srun tasks, each a torchrun with one worker, meeting at the c10d
    rendezvous as two nodes would; USR1 to every process of the step (torchrun ignores it, each worker
    stops), rank 0 requeues the job, and the second run finishes with the 2-rank losses."""
    job, stopped, final = drills.result("two-nodes")
    stopped_by_usr1_and_requeued(drills, job, stopped, final, "two_ranks")
    ran_again_and_finished(job, final)


def test_the_prepare_array_script_prepares_three_parts_and_merges_them(drills, tmp_path):
    """examples/slurm/prepare-array.sbatch as shipped: 3 array tasks, each `prepare --part I/3`, then the
    merge job once all succeeded; the data dir equals one prepare of the same corpus in one process."""
    from pretrainer.data.prepare import prepare
    from pretrainer.data.sources import Corpus

    array, final, out, corpus = drills.result("prepare-array")
    assert sorted(int(task["ArrayTaskId"]) for task in array) == [1, 2, 3]
    merge_log = (drills.root / "prepare-array-merge.out").read_text()
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", f"{final}\n{merge_log[-3000:]}"
    for task in (1, 2, 3):
        assert f"part {task}/3" in (drills.root / f"prepare-array-{task}.out").read_text()
    assert "kept 3 of 3 units tokenized before" in merge_log and f"wrote {out}" in merge_log
    reference = tmp_path / "reference"
    tokenizer = drills.root / "tokenizer-data"
    prepare(
        Corpus([str(corpus)]), "gpt2", reference, tokenizer_from=str(tokenizer), val_fraction=0.05, workers=1
    )
    names = sorted(p.name for p in reference.iterdir() if p.name != "manifest.json")
    assert names == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    assert all((out / n).read_bytes() == (reference / n).read_bytes() for n in names)
    ours, theirs = (json.loads((d / "manifest.json").read_text())["splits"] for d in (out, reference))
    assert ours == theirs and not Path(f"{out}.prepare").exists()
