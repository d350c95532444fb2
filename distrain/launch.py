"""Starting local workers through torchrun's own machinery (torch.distributed.run and its elastic
agent), never a hand-made process pool. `distrain train --nproc N` lands here; a user with their
own launcher runs `torchrun ... -m distrain.train` instead and skips this module."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from distrain.errors import DistrainError

WORKER_MODULE = "distrain.train"


def under_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets the env contract)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(nproc: int, worker_argv: list[str], *, run_dir: str) -> None:
    """Run `python -m distrain.train worker_argv` on `nproc` local processes (standalone)."""
    torchrun_argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--module",
        WORKER_MODULE,
        *worker_argv,
    ]
    try:
        run(get_args_parser().parse_args(torchrun_argv))
    except ChildFailedError as e:
        failed = ", ".join(
            f"rank {rank} (exit code {failure.exitcode})"
            for rank, failure in sorted(e.failures.items())
        )
        raise DistrainError(
            f"worker(s) failed: {failed}; see the error above and {run_dir}/logs/rank<N>.log"
        ) from None
