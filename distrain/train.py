"""Worker entry point: `python -m distrain.train [options]`, started by `distrain train` through
torchrun's API, or directly by a user's own `torchrun --nproc-per-node N -m distrain.train ...`.
Without a torchrun environment it trains in this one process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from distrain.args import parse_train_args
from distrain.config import Config
from distrain.config_io import write_toml
from distrain.errors import DistrainError
from distrain.mesh import device_type, init_distributed
from distrain.observe import flight
from distrain.observe.logs import close_logging, setup_logging
from distrain.observe.watchdog import start_watchdog
from distrain.trainer import Trainer


def release_process_groups() -> None:
    """Let gloo's worker threads finish dropping the tensors of completed collectives.

    A worker that releases the last reference to a Python-visible tensor needs the GIL. When the
    DDP reducer is freed it destroys its ProcessGroupGloo, which joins those workers while the
    main thread holds the GIL: a deadlock at exit (seen here in about half of 2-rank runs). A
    GIL-releasing pause before the release lets the workers finish; their pending work is only
    bookkeeping of collectives that already completed, so 0.1 s is ample.
    """
    time.sleep(0.1)


def run_training(cfg: Config) -> None:
    """Train per `cfg` in this process as one rank of the (possibly 1-process) group."""
    run_dir = Path(cfg.run.dir)
    nccl = device_type(cfg.run.device) == "cuda"
    if cfg.debug.hang_timeout_s:
        flight.enable(run_dir, nccl=nccl)
    ctx = init_distributed(cfg.run.device, timeout_s=cfg.debug.collective_timeout_s)
    logger = None
    trainer = None
    watchdog = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if ctx.rank == 0:
            write_toml(cfg, run_dir / "config.toml")
        logger = setup_logging(run_dir, ctx.rank)
        logger.info("rank %d/%d on %s (%s)", ctx.rank, ctx.world_size, ctx.device, ctx.backend)
        trainer = Trainer(cfg, ctx, logger)
        if cfg.debug.hang_timeout_s:
            watchdog = start_watchdog(
                run_dir,
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout_s=cfg.debug.hang_timeout_s,
                logger=logger,
                nccl=nccl,
            )
        trainer.run()
    except DistrainError as e:
        if logger is not None:
            logger.error("%s", e)
        raise
    except Exception:
        # The traceback goes to the rank's log too, where `distrain diagnose` finds it.
        if logger is not None:
            logger.exception("rank %d failed", ctx.rank)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if trainer is not None:
            trainer.close()
        if logger is not None:
            close_logging(logger)
        release_process_groups()
        del trainer
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    try:
        _, cfg = parse_train_args(sys.argv[1:] if argv is None else argv, worker=True)
        run_training(cfg)
    except DistrainError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
