"""How the benchmark scripts run on several ranks: a script started by hand re-launches itself on
N local ranks through torchrun's API (the elastic agent, standalone rendezvous); started by
torchrun (RANK set), it is a worker."""

from __future__ import annotations

import os
import shutil
import tempfile

from torch.distributed.run import get_args_parser, run


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
