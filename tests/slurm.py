"""A real Slurm (Debian's slurm-wlm 22.05: slurmctld, slurmd, munge) on this machine, for tests.

`slurm_cluster(num_nodes)` writes a minimal slurm.conf into a fresh temporary dir, starts its own
munged (own key and socket), slurmctld and one slurmd per node, waits until every node is idle
and yields a `SlurmCluster`; on exit it cancels what is left and stops the daemons. Nothing
outside the temporary dir is touched: the client commands find the cluster through
`SlurmCluster.env` (SLURM_CONF), which the module fixture `slurm` also applies to os.environ.

Several nodes on one machine use slurmd's multiple-slurmd mode (`slurmd -N NAME`, one port per
node, all at 127.0.0.1), when the build has it; `multiple_slurmd_supported()` tells.

The daemons run as root (they start job steps as the submitting user); `slurm_unavailable()`
says why a machine cannot host them (not root, Slurm not installed), for skip reasons.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
STARTUP_TIMEOUT_S = 60.0


def slurm_unavailable() -> str | None:
    """Why this machine cannot run the test cluster, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install -y "
            "slurmctld slurmd munge slurm-client"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps, and this test runs as a user"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SlurmCluster:
    """A running test cluster: its dir, node names and the env that points clients at it."""

    root: Path
    nodes: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def child_env(self, **extra: str) -> dict[str, str]:
        """os.environ without another cluster's job variables, plus `env` and `extra`."""
        merged = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        merged.update(self.env, **extra)
        return merged

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.child_env(), check=check, timeout=60
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as KEY -> VALUE (the job's state is "JobState")."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_state(self, job_id: str, states: set[str], timeout: float = 300) -> dict[str, str]:
        """Poll until the job's state is one of `states`; returns its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {fields.get('JobState')}: {fields}")
            time.sleep(0.5)

    def log_tail(self) -> str:
        """The daemons' last log lines, for assertion messages."""
        parts = []
        for log in sorted(self.root.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)


def multiple_slurmd_supported() -> bool:
    """Whether slurmd was built with --enable-multiple-slurmd (the `-N NAME` option works)."""
    probe = subprocess.run(["slurmd", "-N", "probe", "-C"], capture_output=True, text=True)
    return "multiple-slurmd" not in (probe.stdout + probe.stderr).lower()


def _conf(root: Path, nodes: list[str], ports: dict[str, int], cpus: int) -> str:
    hostname = socket.gethostname()
    lines = [
        "ClusterName=distrain-test",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={ports['slurmctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        # No cgroups in a container: track processes by parentage, bind nothing.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "MailProg=/bin/true",
        # Quick turnaround for tests: requeued jobs may start again at once, and a job past its
        # limit is killed 5 s after its SIGTERM.
        "KillWait=5",
        "MinJobAge=600",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
    ]
    for name in nodes:
        lines.append(
            f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={ports[name]} "
            f"CPUs={cpus} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def slurm_cluster(num_nodes: int = 1) -> Iterator[SlurmCluster]:
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="distrain-slurm-"))
    os.chmod(root, 0o700)  # munged refuses a socket dir that others may write
    hostname = socket.gethostname()
    nodes = [hostname] if num_nodes == 1 else [f"node{i}" for i in range(num_nodes)]
    ports = {name: _free_port() for name in ["slurmctld", *nodes]}
    (root / "state").mkdir()
    for name in nodes:
        (root / f"spool-{name}").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, nodes, ports, os.cpu_count() or 1))
    cluster = SlurmCluster(root, nodes, {"SLURM_CONF": str(conf)})
    env = cluster.child_env()
    procs: list[subprocess.Popen] = []

    def daemon(*argv: str, log: str) -> None:
        with open(root / log, "ab") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=out, env=env))

    try:
        subprocess.run(
            ["mungekey", "--create", f"--keyfile={root}/munge.key"], check=True, capture_output=True
        )
        daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={root}/munge.socket",
            f"--key-file={root}/munge.key",
            f"--pid-file={root}/munged.pid",
            f"--seed-file={root}/munged.seed",
            f"--log-file={root}/munged.log",
            log="munged.out",
        )
        _wait(lambda: (root / "munge.socket").exists(), "munged", cluster)
        daemon("slurmctld", "-D", "-i", "-f", str(conf), log="slurmctld.out")
        for name in nodes:
            named = ["-N", name] if num_nodes > 1 else []
            daemon("slurmd", "-D", *named, "-f", str(conf), log=f"slurmd-{name}.out")

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            return all(states.get(name) == "idle" for name in nodes)

        _wait(idle, "slurmd nodes idle", cluster)
        yield cluster
    finally:
        subprocess.run(
            ["scancel", "--full", "--user", "root"],
            env=env,
            capture_output=True,
            timeout=30,
            check=False,
        )
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait(ready, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what}: not ready after {STARTUP_TIMEOUT_S:.0f}s\n{cluster.log_tail()}"
            )
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A one-node cluster for the module; SLURM_CONF applied to os.environ meanwhile."""
    with slurm_cluster(1) as cluster:
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
