"""Starting workers through torchrun's own machinery (torch.distributed.run and its elastic agent),
never a hand-made process pool. `distrain train --nproc N` lands here; a user with their own
launcher runs `torchrun ... -m distrain.train` instead and skips this module.

Two modes. Standalone (the default): one node, a private rendezvous on a free local port. Elastic
(any of --nnodes, --node-rank, --rdzv-endpoint, --rdzv-id): a c10d rendezvous that agents on one
or more machines join, so membership may change between attempts. In both, --max-restarts lets the
agent restart a failed worker group; the restarted workers resume from the newest complete
checkpoint on their own (the trainer does that), so a restart costs at most the steps since it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from distrain.checkpoint.storage import Storage
from distrain.errors import ConfigError, DistrainError
from distrain.launch.lifeline import LAUNCHER_PID_ENV
from distrain.launch.preempt import EXIT_PREEMPTED, STOP_SIGNALS, launcher_outcome
from distrain.launch.rundir import HELD_BY_LAUNCHER_ENV, LOCK_NAME, RunDirLock
from distrain.launch.worker_errors import reported
from distrain.torch_compat import torchrun_shutdown_timeout

WORKER_MODULE = "distrain.train"
# torchrun's c10d rendezvous waits this long for more nodes once MIN have joined (its default, 30 s,
# is paid at every restart). 1 s still lets agents that start together join one round.
LAST_CALL_TIMEOUT_S = 1
# The agent turns these into a shutdown that forwards the same signal to the workers (SIGUSR1
# is not among torchrun's defaults: it would kill the agent and orphan the workers).
AGENT_SIGNALS = ",".join(sorted({s.name for s in STOP_SIGNALS} | {"SIGHUP", "SIGQUIT"}))
# The workers end themselves once the grace period is spent; the agent's SIGKILL comes later.
SHUTDOWN_MARGIN_S = 5


def under_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets the env contract)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def new_rdzv_id() -> str:
    """A rendezvous id of this launch's own. It becomes the workers' torchelastic run id, which
    the run-dir lock takes for "an earlier attempt of this job": an id shared by unrelated
    launches would let one run take over another's live run dir."""
    return f"distrain-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """How many workers to start where, and how they find each other."""

    nproc: int
    """Workers on this node."""
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int = 0
    """Restarts of the worker group after a failure, before the run fails."""
    elastic: bool = False
    """c10d rendezvous that other agents may join (else torchrun --standalone)."""
    node_rank: int | None = None
    """Node 0 hosts the rendezvous store; None lets torchrun decide from the endpoint's host."""
    rdzv_endpoint: str | None = None
    rdzv_id: str = field(default_factory=new_rdzv_id)
    grace_s: int = 120
    """How long a stop signal lets the workers run before the agent kills them."""
    local_groups: int = 1
    """Torchruns of this run on this host, each starting nproc workers: the replica groups that
    share it (ft/network.py `groups_on_this_host`), else 1. The workers' threads share the
    cores among all of them."""

    @property
    def world_size(self) -> int | None:
        """The number of ranks when every attempt has the same one, else None."""
        return self.nproc * self.min_nodes if self.min_nodes == self.max_nodes else None


def parse_nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max) with 1 <= min <= max."""
    try:
        bounds = [int(part) for part in text.split(":")]
    except ValueError:
        bounds = []
    if len(bounds) not in (1, 2):
        raise ConfigError(f"--nnodes: expected N or MIN:MAX (integers), got {text!r}")
    low, high = bounds[0], bounds[-1]
    if not 1 <= low <= high:
        raise ConfigError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return low, high


def parse_endpoint(text: str) -> str:
    """Check `HOST:PORT` (an IPv6 host in brackets) and return it unchanged."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint: expected HOST:PORT with a port in 1..65535, got {text!r}"
        )
    return text


def make_plan(
    nproc: int,
    *,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    max_restarts: int,
    grace_s: int = 120,
    local_groups: int = 1,
) -> LaunchPlan:
    """Validate the launch options together; every error is one line naming the option."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    min_nodes, max_nodes = parse_nnodes(nnodes) if nnodes is not None else (1, 1)
    if node_rank is not None and not 0 <= node_rank < max_nodes:
        raise ConfigError(f"--node-rank must be in [0, {max_nodes}) for --nnodes {nnodes}")
    if rdzv_endpoint is not None:
        parse_endpoint(rdzv_endpoint)
    elif max_nodes > 1:
        raise ConfigError(
            f"--nnodes {nnodes} lets other nodes join: give every node --rdzv-endpoint HOST:PORT "
            "(an address of node 0, where the rendezvous store runs)"
        )
    if rdzv_id == "":
        raise ConfigError("--rdzv-id must not be empty")
    if rdzv_id is None and max_nodes > 1:
        raise ConfigError(
            f"--nnodes {nnodes} lets other nodes join: give every node the same --rdzv-id "
            "(without it, each launch has an id of its own)"
        )
    return LaunchPlan(
        nproc=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        max_restarts=max_restarts,
        elastic=any(v is not None for v in (nnodes, node_rank, rdzv_endpoint, rdzv_id)),
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id or new_rdzv_id(),
        grace_s=grace_s,
        local_groups=local_groups,
    )


def torchrun_argv(plan: LaunchPlan, worker_argv: list[str]) -> list[str]:
    """torchrun's arguments for `plan`, ending with `-m distrain.train worker_argv`."""
    rdzv_conf = [f"last_call_timeout={LAST_CALL_TIMEOUT_S}"]
    if plan.elastic:
        # Without an endpoint this node hosts a private store on a free port, as --standalone does.
        endpoint = plan.rdzv_endpoint or "localhost:0"
        if plan.node_rank is not None:
            # Decides who serves the store at the endpoint, so agents sharing one machine (all of
            # whom match the endpoint's host) don't rely on torchrun's bind-and-retry guess.
            # Global ranks still come from the rendezvous's join order, not from this number.
            rdzv_conf.append(f"is_host={str(plan.node_rank == 0).lower()}")
        where = [
            f"--nnodes={plan.min_nodes}:{plan.max_nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={plan.rdzv_id}",
        ]
    else:
        where = ["--standalone"]
    return [
        *where,
        f"--rdzv-conf={','.join(rdzv_conf)}",
        f"--nproc-per-node={plan.nproc}",
        f"--max-restarts={plan.max_restarts}",
        f"--signals-to-handle={AGENT_SIGNALS}",
        *torchrun_shutdown_timeout(plan.grace_s + SHUTDOWN_MARGIN_S),
        "--module",
        WORKER_MODULE,
        *worker_argv,
    ]


def worker_threads(nproc: int, local_groups: int = 1) -> tuple[int, str]:
    """CPU threads per worker (torch's intra-op pool) and where the number comes from: the
    user's OMP_NUM_THREADS if set, else this node's usable cores shared by every worker this
    run starts on it: `nproc` per torchrun, of `local_groups` torchruns (replica groups on one
    host)."""
    if "OMP_NUM_THREADS" in os.environ:
        text = os.environ["OMP_NUM_THREADS"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={text!r}: expected a positive integer, or unset it")
        return int(text), "OMP_NUM_THREADS from the environment"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = nproc * local_groups
    groups = f" of {local_groups} replica groups on this host" if local_groups > 1 else ""
    return max(1, (cores or 1) // workers), f"{cores} cores / {workers} workers{groups}"


def worker_env(plan: LaunchPlan) -> dict[str, str]:
    """Environment the workers inherit from this process (torchrun's agent copies it), set only
    while the agent runs (`_environ`)."""
    threads, why = worker_threads(plan.nproc, plan.local_groups)
    print(f"[distrain] {threads} CPU thread(s) per worker ({why})", file=sys.stderr)
    # `python -m distrain.train` would put the working directory first on sys.path, so a folder
    # named distrain/ there (the parent of a clone, say) would shadow the package this launcher
    # runs. Safe-path mode drops that entry; the package's own root is put on the path instead.
    package_root = str(Path(__file__).resolve().parents[2])  # distrain/launch/torchrun.py
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        # Set before torchrun starts the workers, which also silences its warning about it.
        "OMP_NUM_THREADS": str(threads),
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": os.pathsep.join([package_root, *python_path]),
        # Torchrun's agent (this process) is the workers' parent: they exit when it dies.
        LAUNCHER_PID_ENV: str(os.getpid()),
        # Restarted workers must not reuse the agent's TCP store address of the previous
        # attempt: with torch's default (share it) restarts fail with "Gloo connectFullMesh
        # failed" or hang. Read by the agent's rendezvous handler, i.e. in this process.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # torchft's manager server (Rust, in replica groups' workers) logs every quorum at INFO
        # to stderr (most of a replica-group run's console); warnings only, unless asked for.
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
    }


def _quiet_agent(restarts: int = 0) -> None:
    """Torchrun's agent (this process) logs a warning per worker it signals and per signal it
    gets, and an error for a worker that stopped with a preempt checkpoint (exit 75), all of
    which the launcher's own one-line outcome says better. Its errors about failed attempts
    stay when the run may restart (they say why a restart happens); without restarts the
    launcher's line says which ranks failed and why. All stay if torchrun's LOGLEVEL asks for
    other levels."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            agent_logger = logging.getLogger(name)
            agent_logger.setLevel(logging.ERROR)
            for f in [f for f in agent_logger.filters if isinstance(f, _AgentFailures)]:
                agent_logger.removeFilter(f)
            agent_logger.addFilter(_AgentFailures(restarts))


class _AgentFailures(logging.Filter):
    """Drops the agent's "failed (exitcode: 75)" (that worker stopped as asked), and with no
    restart to come its every "failed (exitcode: N)" (the launcher's line says it once)."""

    def __init__(self, restarts: int):
        super().__init__()
        self.restarts = restarts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not self.restarts and "failed (exitcode:" in message:
            return False
        return f"(exitcode: {EXIT_PREEMPTED})" not in message


def _ignore_stop_signals() -> None:
    """The workers are gone and the outcome is being read: a stop signal now (a second SIGTERM
    from Slurm or a user) has nothing left to stop, and must not turn the outcome's exit status
    (75 for a committed preempt checkpoint) into a death by signal."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """`updates` in this process's environment for the agent to copy into the workers', then the
    earlier values back: a torchrun started later from this process must not hand its workers
    our LAUNCHER_PID_ENV (a worker whose parent is not that pid SIGKILLs itself)."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(plan: LaunchPlan, worker_argv: list[str], *, run_dir: str, checkpoints: Storage) -> None:
    """Run `python -m distrain.train worker_argv` on `plan.nproc` processes of this node.

    A stop signal to this process (SIGTERM, SIGUSR1, SIGINT) is forwarded to the workers by
    torchrun's agent, which waits up to the grace period for them; the outcome is then read from
    `checkpoints`: `Preempted` (exit 75) if they committed a preempt checkpoint."""
    env = worker_env(plan)
    _quiet_agent(plan.max_restarts)
    started = time.time()
    # One launcher per job holds the run-dir lock, node 0's, and every launcher tells its
    # workers so. Without --node-rank in an elastic job node 0 is not known here: then the
    # workers' rank 0 takes the lock.
    lock = None
    if not plan.elastic or plan.node_rank is not None:
        if plan.node_rank in (None, 0):
            lock = RunDirLock(Path(run_dir)).acquire()
        env[HELD_BY_LAUNCHER_ENV] = str(Path(run_dir) / LOCK_NAME)
    try:
        with _environ(env):
            run(get_args_parser().parse_args(torchrun_argv(plan, worker_argv)))
    except SignalException as e:
        _ignore_stop_signals()
        raise launcher_outcome(checkpoints, since=started, signum=e.sigval) from None
    except ChildFailedError as e:
        if any(f.exitcode == EXIT_PREEMPTED for f in e.failures.values()):
            # A signal that reached workers only: they stopped with a checkpoint. The agent took
            # the first one's exit 75 for a failure and SIGTERMed the others (those still tearing
            # down die of it), so the checkpoint, not their exit codes, decides.
            _ignore_stop_signals()
            raise launcher_outcome(checkpoints, since=started, signum=None) from None
        logs = Path(run_dir) / "logs"
        error = reported(e.failures, logs=str(logs))
        if error is not None:
            raise error from None
        failed = ", ".join(
            f"rank {rank} (exit code {failure.exitcode})"
            for rank, failure in sorted(e.failures.items())
        )
        attempts = f" after {plan.max_restarts} restart(s)" if plan.max_restarts else ""
        # A worker's native stderr goes to its log (observe/logs.py), what it printed in Python
        # to the console.
        where = f"{logs}/rank<N>.log and the error above" if logs.is_dir() else "the error above"
        raise DistrainError(f"worker(s) failed{attempts}: {failed}; see {where}") from None
    finally:
        if lock is not None:
            lock.release()
