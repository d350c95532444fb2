"""What every benchmark script shares: running on several ranks (a script started by hand
re-launches itself on N local ranks through torchrun's API; started by torchrun, RANK set, it is
a worker), a worker's process group and logger, and writing the JSON result with the record of
its run (command, start and end, load average at both, machine, code; see `run_record`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.run import get_args_parser, run

from distrain.config.schema import Config
from distrain.observe.logs import close_logging, setup_logging
from distrain.parallel.device import DistContext, init_distributed, teardown
from distrain.train.build import build_trainer
from distrain.train.loop import Trainer
from distrain.train.resolve import resolve

# The command's start, set once by the process started by hand and inherited by the ranks it
# launches, so that a JSON a worker writes records the command and start its user typed.
_STARTED_ENV = "DISTRAIN_BENCH_STARTED"
if _STARTED_ENV not in os.environ:
    _script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        _script = _script.relative_to(Path.cwd())
    # The thread count is part of what a CPU figure measured.
    _env = (
        [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"]
        if "OMP_NUM_THREADS" in os.environ
        else []
    )
    os.environ[_STARTED_ENV] = json.dumps(
        {
            "command": shlex.join([*_env, "python3", str(_script), *sys.argv[1:]]),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average_start": list(os.getloadavg()),
        }
    )


def is_worker() -> bool:
    return "RANK" in os.environ


def launch_ranks(script: str, nproc: int, argv: list[str], *, run_dir: str | None = None) -> None:
    """Run `script argv [--run-dir RUN_DIR]` on `nproc` local ranks and wait for them."""
    extra = ["--run-dir", run_dir] if run_dir is not None else []
    run(
        get_args_parser().parse_args(
            ["--standalone", f"--nproc-per-node={nproc}", script, *argv, *extra]
        )
    )


def launch_self(script: str, nproc: int, argv: list[str], *, name: str) -> None:
    """launch_ranks with a temporary run directory shared by the workers, removed afterwards."""
    run_dir = tempfile.mkdtemp(prefix=f"distrain-{name}-")
    try:
        launch_ranks(script, nproc, argv, run_dir=run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def worker_session(
    run_dir: str | Path, device: str = "cpu"
) -> Iterator[tuple[DistContext, logging.Logger]]:
    """This worker's rank context and per-rank logger; torn down however the body ends. Build
    models (anything holding process groups) in functions called from the body, so that they
    are gone by the teardown (see distrain.parallel.device.teardown)."""
    ctx = init_distributed(device)
    logger = setup_logging(Path(run_dir), ctx.rank)
    ended_well = False
    try:
        yield ctx, logger
        ended_well = True
    finally:
        close_logging(logger)
        teardown(synchronize=ended_well)


def trainer_for(cfg: Config, ctx: DistContext, logger: logging.Logger) -> Trainer:
    """distrain's trainer for `cfg` on this process's group, made as the worker makes it: the
    config resolved into the run's plan, then every part built from the plan."""
    return build_trainer(resolve(cfg, ctx.device, ctx.world_size, logger), ctx, logger)


def bench_config(
    run_dir: str | Path,
    *,
    preset: str,
    micro_batch_size: int,
    seq_len: int,
    global_batch_size: int,
    steps: int,
    max_bytes: int,
    device: str | None = None,
    **fields: object,
) -> Config:
    """A validated Config for a benchmark's run: the model, batch and step count given, the first
    `max_bytes` of the corpus, and nothing the timing should not include (no progress bar,
    TensorBoard or checkpoints). `device` None keeps the config's default (CUDA where present);
    `fields` sets further fields by `section__field` name (e.g. parallel__cp=2)."""
    cfg = Config()
    cfg.run.dir = str(run_dir)
    if device is not None:
        cfg.run.device = device
    cfg.model.preset = preset
    cfg.data.max_bytes = max_bytes
    t = cfg.training
    t.micro_batch_size = micro_batch_size
    t.seq_len = seq_len
    t.global_batch_size = global_batch_size
    t.steps = steps
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    cfg.checkpoint.at_end = False
    cfg.checkpoint.interval_steps = 0
    for name, value in fields.items():
        section, field = name.split("__")
        if not hasattr(getattr(cfg, section), field):
            raise AttributeError(f"bench_config: no config field {section}.{field}")
        setattr(getattr(cfg, section), field, value)
    cfg.validate()
    return cfg


def wait_all(procs: list[subprocess.Popen], log: Path, *, timeout_s: float) -> None:
    """Wait for every process of a run (at most `timeout_s` in all); on a failure kill the rest
    and raise with the tail of the run's log."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            for other in procs:
                other.kill()
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"run failed (exit {code}), log {log}:\n{tail}")


def run_record() -> dict[str, Any]:
    """What a figure needs to be judged and recomputed: the command as typed, its start and end
    (UTC), the 1/5/15-minute load average at both, the machine (CPU model, cores, memory, GPU)
    and the code (torch version, git commit, whether distrain/ or a benchmark script had
    uncommitted changes)."""
    record = json.loads(os.environ[_STARTED_ENV])
    record["ended"] = datetime.now(UTC).isoformat(timespec="seconds")
    record["load_average_end"] = list(os.getloadavg())
    record["machine"] = _machine()
    record["torch"] = torch.__version__
    record["commit"] = _git("rev-parse", "--short", "HEAD")
    # ":/" roots each pathspec at the repository's top: _git runs in benchmarks/, where a plain
    # "distrain" or "benchmarks/*.py" names nothing and the flag stayed False whatever changed.
    record["uncommitted_changes"] = bool(
        _git(
            "status", "--porcelain", "--untracked-files=no", "--", ":/distrain",
            ":/benchmarks/*.py",
        )
    )  # fmt: skip
    return record


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError, ValueError):
        kib = Path("/proc/meminfo").read_text().split("MemTotal:", 1)[1].split()[0]
        memory_gib = round(int(kib) / 2**20, 1)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gib, "gpu": gpu}


def _git(*args: str) -> str:
    here = Path(__file__).resolve().parent
    done = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write `result` with the run's record (`run_record`) under the key "record"."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "record": run_record()}, indent=2) + "\n")
    print(f"wrote {out}")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; CPU work does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_steps(
    trainer: Trainer, *, warmup: int, steps: int, device: torch.device, report_loss: bool = True
) -> float:
    """Seconds for `steps` training steps after `warmup` untimed ones, on the slowest rank."""

    def step() -> None:
        trainer.train_step(trainer.loader.next_batch(), report_loss=report_loss)
        trainer.step += 1

    for _ in range(warmup):
        step()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
