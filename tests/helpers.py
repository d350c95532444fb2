"""Test helpers: run distrain in this process (1 rank) or through the CLI (N ranks, torchrun);
start a process group in a test (`process_group`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrain.config.io import load_config
from distrain.observe.metrics import read_metrics

if TYPE_CHECKING:
    import pytest

    from distrain.config.schema import Config

# Small enough for CI's 2 cores, big enough that the loss moves: 4 MB of stdlib source.
FAST = {
    "data.max_bytes": "4000000",
    "training.log_interval_steps": "1",
    "training.eval_interval_steps": "0",
    # Two global batches per validation pass, spread over the split as the default's are (the
    # default scores up to 131,072 tokens: seconds a pass, at every test run's end).
    "training.eval_batches": "2",
    "metrics.progress_bar": "false",
    "metrics.tensorboard": "false",
}


# A small multi-process run: global batch 8 in micro-batches of 2 (4 ranks need no accumulation,
# 2 ranks accumulate 2, so one run continues on either), deterministic kernels.
SMALL_RUN = {
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": 64,
    "training__deterministic": True,
}


def overrides(run_dir: Path, **fields: object) -> list[tuple[str, str]]:
    """FAST plus `fields` (section__field=value), as (dotted, text) pairs."""
    merged = dict(FAST, **{"run.dir": str(run_dir)})
    merged.update(
        {
            k.replace("__", "."): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in fields.items()
        }
    )
    return list(merged.items())


def train_in_process(run_dir: Path, **fields: object) -> list[dict]:
    """Train on 1 rank in this process; returns the run's metrics rows."""
    import torch

    from distrain.train.worker import run_training

    # training.deterministic turns torch's process-wide deterministic mode on: the tests run
    # after this one in this process get the mode they would have had without it.
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        run_training(load_config(None, overrides(run_dir, **fields)))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return read_metrics(run_dir / "metrics.jsonl")


def plan_of(cfg: Config, world_size: int) -> Any:
    """`cfg`'s `RunPlan` on `world_size` CPU ranks: the layout rules checked, "auto" decided."""
    import torch

    from distrain.layout.rules import validate
    from distrain.parallel.run_plan import RunPlan

    layout = validate(cfg, world_size)
    return RunPlan.decided(
        cfg, spec=layout.spec, model=layout.model, dims=layout.dims, device=torch.device("cpu")
    )


def real_step_memory(
    cfg: Config, batches: list[tuple[Any, Any]], prepare: Any = None
) -> dict[str, int]:
    """This rank's bytes over a real training step of `batches` (micro-batches of (tokens,
    targets)) on CPU, in a process group of every rank of `cfg` already made, counted as the
    planner counts a fake build: the model states after a first step, and the peak above
    parameters and gradients during a later step's forward and backward (gradients None before
    it, the optimizer state already made; its first micro-batch holds no gradients yet, as
    `estimate_memory`'s accumulating=False). That peak is the lower of two such steps: when
    gloo's threads finish a collective moves when its buffers are freed, and on a loaded machine
    a step's peak now and then holds one more (measured: +1.4% to +7.5% of the activations, in
    a few of 50 runs, the same inputs), which the fake build, whose collectives return at once,
    does not. `prepare(model)`: called on the model once it is built."""
    import torch
    import torch.distributed as dist

    from distrain.optim.builder import build_optimizer
    from distrain.parallel.compress import CommStats
    from distrain.parallel.device import DistContext
    from distrain.parallel.parallelize import parallelize
    from distrain.plan.memory import LiveBytes, grad_bytes, held_optimizer_state_bytes, local_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_of(cfg, world)
    ctx = DistContext(
        rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo"
    )
    mesh, dp_mesh = plan.dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = parallelize(plan, mesh, dp_mesh, ctx, CommStats())
    if prepare is not None:
        prepare(model)
    optimizers = [build_optimizer(p, cfg.optim, spec=plan.spec) for p in model.parts]
    model.forward_backward(batches, lambda loss: loss, report_loss=False)
    for optimizer in optimizers:
        optimizer.step()
    params = sum(local_bytes(p) for p in model.parameters())
    peaks = []
    for _ in range(2):
        model.zero_grad()
        with LiveBytes(params) as live:
            model.forward_backward(batches, lambda loss: loss, report_loss=False)
        peaks.append(live.peak)
    grads = grad_bytes(model.parameters())
    return {
        "params": params,
        "grads": grads,
        "optimizer": held_optimizer_state_bytes(optimizers),
        "activations": min(peaks) - params - grads,
    }


@contextlib.contextmanager
def process_group(
    rank: int = 0,
    world_size: int = 1,
    *,
    store_file: Path | None = None,
    timeout_s: float | None = None,
) -> Iterator[None]:
    """The one way a test starts a (gloo) process group: rank `rank` of `world_size`, destroyed
    on exit however the block ends (unless the block already ended it), so that no group
    outlives its test into the next. One rank meets itself in memory (a HashStore); the ranks of
    several processes meet through `store_file` (a FileStore: one unused path, every rank's),
    which needs no port: no port picked free beforehand that another process can take first.
    `timeout_s`: how long a collective waits (torch's default where None), so that ranks that
    disagree fail the test instead of hanging it."""
    import torch.distributed as dist

    if store_file is None and world_size > 1:
        raise ValueError("ranks in several processes meet through a store_file")
    store = dist.HashStore() if store_file is None else dist.FileStore(str(store_file), world_size)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group(cfg: Config) -> Iterator[tuple[Any, Any, Any, Any]]:
    """`cfg` planned for one process inside a real 1-process gloo group (`process_group`):
    (RunPlan, DistContext, mesh, data-parallel mesh), what `parallelize` takes."""
    import torch

    from distrain.parallel.device import DistContext

    with process_group():
        plan = plan_of(cfg, 1)
        ctx = DistContext(
            rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"
        )
        yield (plan, ctx, *plan.dims.build_mesh("cpu"))


def run_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "distrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def cli_in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`distrain args` through `distrain.cli.main` in this process, as `run_cli` reports it: for
    a command that starts no worker (a refusal before launch, `slurm --dry-run`), which then
    costs no new interpreter importing torch (~3 s of CI each). test_validation keeps a real
    process's refusal."""
    from distrain.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["distrain", *args], code, out, err)


def train_cli(run_dir: Path, nproc: int, **fields: object) -> subprocess.CompletedProcess:
    args = ["train", "--nproc", str(nproc)]
    for key, value in overrides(run_dir, **fields):
        args += [f"--{key}", value]
    return run_cli(*args)


def losses(rows: list[dict]) -> dict[int, float]:
    """step -> training loss; a later row for the same step (after a resume) wins."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def val_losses(rows: list[dict]) -> dict[int, float]:
    """step -> validation loss (the held-out split's)."""
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def free_port() -> int:
    """A port no one listens on now: the OS picks it for a socket bound to port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_train(
    run_dir: Path, *launch_args: str, env: dict[str, str] | None = None, **fields: object
) -> subprocess.Popen:
    """`distrain train launch_args --section.field value ...` in the background (`env`: more
    environment variables)."""
    args = [sys.executable, "-m", "distrain", "train", *launch_args]
    for key, value in overrides(run_dir, **fields):
        args += [f"--{key}", value]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
    )


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (none when it ended meanwhile, as a killed worker does)."""
    children: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process ended after its parent listed it
        return []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return children + [d for c in children for d in _descendants(c)]


def worker_pid(agent_pid: int, rank: int, *, restart: int = 0) -> int | None:
    """The pid of the worker of global rank `rank` in a torchrun agent's `restart`-th worker
    group, if it is running."""
    wanted = {f"RANK={rank}".encode(), f"TORCHELASTIC_RESTART_COUNT={restart}".encode()}
    for pid in _descendants(agent_pid):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            return pid
    return None


def small_cluster(gpus: int, memory_bytes: float):  # -> distrain.plan.timing.Cluster
    """One node of `gpus` devices of `memory_bytes`, 1 TFLOP/s at full efficiency, 1 GB/s
    inside the node: the planner tests' cluster."""
    from distrain.plan.timing import Cluster

    return Cluster(
        nodes=1,
        gpus_per_node=gpus,
        memory_bytes=memory_bytes,
        peak_flops=1e12,
        efficiency=1.0,
        intra_bw=1e9,
        inter_bw=1e8,
    )


def layouts_of(cfg: Config, cluster: Any, **kwargs: Any) -> list:
    """search.candidates of `cfg` on `cluster`: its model's shape, global batch and replica
    groups (`kwargs`: the stages and checkpointing searched)."""
    from distrain.plan.memory_model import model_of
    from distrain.plan.search import candidates

    return candidates(
        model_of(cfg.model).shape,
        cluster,
        global_batch=cfg.training.global_batch_size,
        replica_groups=cfg.fault_tolerance.replica_groups,
        **kwargs,
    )
