"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd started in the foreground
(their exact PIDs held), all state under one scratch dir, and SLURM_CONF naming a generated slurm.conf.

No systemd, no cgroups (proctrack/linuxproc, task/none), daemons and jobs as root. Settings that make
a test fast and never hang (measured in the SLURM notes): a requeued job runs again ~7 s later
(AuthInfo cred_expire=5, sched_interval=2, bf_interval=1, instead of ~163 s), and a request the node
cannot satisfy is refused by sbatch at once (EnforcePartLimits=ALL) instead of pending forever.
Its own ports, munge socket, state and spool dirs: a cluster another session left running (on the
default ports and /run/munge) is neither used nor disturbed, and stop() ends only this one's PIDs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", "srun")
NODE_CPUS = 8  # more than the machine's 2 (config_overrides): the drills' jobs run side by side
# a job in one of these is over (COMPLETING, its processes still ending, is not)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
INSTALL_HINT = "scripts/install-test-deps.sh installs slurm-wlm and munge (as root)"


class SlurmUnavailable(Exception):
    """SLURM cannot run here (not installed, not root, or a daemon did not start): the reason."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _find(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).is_file()), None
    )


def slurm_conf(scratch: Path, host: str, munge_socket: Path) -> str:
    ctld_port, slurmd_port = free_port(), free_port()
    return f"""\
ClusterName=pretrainer-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5 (the minimum): a requeued job waits 5 s, not 120 s, for its node's credential to expire
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/spool
SlurmctldPidFile={scratch}/slurmctld.pid
SlurmdPidFile={scratch}/slurmd.pid
SlurmctldLogFile={scratch}/slurmctld.log
SlurmdLogFile={scratch}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
EnforcePartLimits=ALL
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={host} CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    scratch: Path
    env: dict  # os.environ plus SLURM_CONF: for the clients and for the jobs they submit
    pids: dict = field(default_factory=dict)  # daemon name -> Popen

    @property
    def conf(self) -> Path:
        return self.scratch / "slurm.conf"

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(c) for c in command], capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, command))}: exit {result.returncode}\n{result.stderr}")
        return result

    def sbatch(self, *args, env: dict | None = None) -> int:
        """sbatch ARGS (options, then the script and its arguments) -> the job id. `env`: added to the
        environment the job inherits (sbatch exports the submitter's)."""
        result = subprocess.run(
            ["sbatch", "--parsable", *map(str, args)],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=30,
        )
        if result.returncode != 0:
            command = " ".join(map(str, args))
            raise RuntimeError(f"sbatch {command}: exit {result.returncode}\n{result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o JOBID` as {field: value} (JobState, Restarts, ExitCode, ...); {} when the
        controller no longer knows the job (it forgets a finished one after MinJobAge, 300 s)."""
        return self.jobs(job_id).get(job_id, {})

    def jobs(self, job_id: int | None = None) -> dict[int, dict[str, str]]:
        """Every job the controller knows (or the one), one `scontrol show job` call: {id: fields}."""
        result = self.run("scontrol", "show", "job", "-o", *([str(job_id)] if job_id else []), check=False)
        found = {}
        for line in result.stdout.splitlines() if result.returncode == 0 else []:
            fields = dict(re.findall(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)", line.strip()))
            if fields.get("JobId", "").isdigit():
                found[int(fields["JobId"])] = fields
        return found

    def scancel(self, job_id: int, *options: str) -> None:
        self.run("scancel", *options, str(job_id))

    def log_tail(self, lines: int = 30) -> str:
        tails = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log"):
            if (path := self.scratch / name).exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append("\n".join([f"--- {path}", *tail]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel every job of this cluster (its slurmstepd processes outlive slurmd), then end the
        daemons by PID: TERM, then KILL after 10 s."""
        if self.pids.get("slurmctld") and self.pids["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.run("scancel", "--user=root", check=False, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    queue = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                    if queue.returncode != 0 or not queue.stdout.strip():
                        break
                    time.sleep(0.2)
        for name in reversed(DAEMONS):
            proc = self.pids.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(check, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for name, proc in cluster.pids.items():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited {proc.returncode}\n{cluster.log_tail()}")
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"{what} not within {timeout} s\n{cluster.log_tail()}")
        time.sleep(0.05)


def start_cluster(scratch: Path | None = None, timeout: float = 30) -> SlurmCluster:
    """Start munged, slurmctld and slurmd on this machine -> the cluster, its one node idle.
    SlurmUnavailable (with the reason) where that cannot be done; whatever was started is stopped."""
    missing = [name for name in DAEMONS + CLIENTS + ("munge", "unmunge") if _find(name) is None]
    if missing:
        raise SlurmUnavailable(f"SLURM is not installed (no {', '.join(missing)}); {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster runs its daemons and jobs as root; this is not root")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        raise SlurmUnavailable(f"the hostname {host!r} does not resolve (add it to /etc/hosts)") from None
    scratch = Path(scratch or tempfile.mkdtemp(prefix="pretrainer-slurm-"))
    scratch.chmod(0o755)  # the munge user reaches its socket dir through it
    munge_dir = scratch / "munge"
    for sub in ("state", "spool", "munge"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    shutil.chown(munge_dir, "munge", "munge")
    munge_dir.chmod(0o755)
    munge_socket = munge_dir / "munge.socket"
    (scratch / "slurm.conf").write_text(slurm_conf(scratch, host, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(scratch / "slurm.conf")}
    for name in list(env):  # a job's own variables (tests run inside a job) would misdirect the clients
        if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
            del env[name]
    cluster = SlurmCluster(scratch, env)
    logs = []

    def daemon(name: str, command: list[str], user: str | None = None) -> None:
        log = open(scratch / f"{name}.out", "w")
        logs.append(log)
        cluster.pids[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, user=user, start_new_session=True
        )

    try:
        daemon(
            "munged",
            [
                _find("munged"),
                "--foreground",
                f"--socket={munge_socket}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={munge_dir}/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
            user="munge",
        )

        def munge_works() -> bool:
            encoded = subprocess.run(
                ["munge", "-n", f"--socket={munge_socket}"], capture_output=True, env=env
            )
            decoded = subprocess.run(
                ["unmunge", f"--socket={munge_socket}"], input=encoded.stdout, capture_output=True, env=env
            )
            return encoded.returncode == 0 and decoded.returncode == 0

        _wait(munge_works, timeout, "munge -n | unmunge", cluster)
        daemon("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
        daemon("slurmd", [_find("slurmd"), "-D", "-f", str(cluster.conf)])

        def node_idle() -> bool:
            result = cluster.run("sinfo", "-h", "-o", "%T", check=False, timeout=10)
            return result.returncode == 0 and result.stdout.strip() == "idle"

        _wait(node_idle, timeout, "the node idle (sinfo -h -o %T)", cluster)
    except BaseException:
        cluster.stop()
        raise
    finally:
        for log in logs:
            log.close()
    return cluster
