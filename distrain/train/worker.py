"""Worker entry point: `python -m distrain.train [options]`, started by `distrain train` through
torchrun's API, or directly by a user's own `torchrun --nproc-per-node N -m distrain.train ...`.
Without a torchrun environment it trains in this one process."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.config.args import parse_train_args
from distrain.config.io import config_changes, write_toml
from distrain.config.schema import Config
from distrain.errors import DistrainError
from distrain.launch.lifeline import LAUNCHER_PID_ENV, die_with_launcher
from distrain.launch.rundir import RunDirBusy, StartFootprint, lock_for_worker
from distrain.launch.torchrun import under_torchrun
from distrain.launch.worker_errors import report, report_unexpected
from distrain.observe import flight
from distrain.observe.logs import FILE_ONLY, close_logging, native_stderr_to, setup_logging
from distrain.observe.watchdog import start_watchdog
from distrain.parallel.device import device_type, init_distributed, teardown
from distrain.train.build import build_trainer
from distrain.train.resolve import resolve


def run_training(config: Config) -> None:
    """Train per `config` in this process: one rank of the torchrun group its environment
    describes, or alone in a 1-process group; returns when the run ends (raises a
    `DistrainError` naming what to fix)."""
    if under_torchrun():
        die_with_launcher()
    run_dir = Path(config.run.dir)
    nccl = device_type(config.run.device) == "cuda"
    if config.watchdog.hang_timeout_s:
        flight.enable(run_dir, nccl=nccl)
    # Taken before joining the group and so before any rank writes: every rank's view of what
    # existed before this start is the same.
    footprint = StartFootprint(run_dir, int(os.environ.get("RANK", 0)))
    ctx = init_distributed(config.run.device, timeout_s=config.comm.collective_timeout_s)
    lock = logger = trainer = watchdog = None
    failed_start = ended_well = wrote_config = False
    native = contextlib.ExitStack()
    try:
        lock = lock_for_worker(run_dir, ctx.rank)
        if ctx.world_size > 1:
            dist.barrier()  # no rank writes to the run dir before rank 0 holds it
        run_dir.mkdir(parents=True, exist_ok=True)
        changed = []
        if ctx.rank == 0:
            changed = _changes_since_last_start(run_dir / "config.toml", config.to_dict())
            write_toml(config, run_dir / "config.toml")
            wrote_config = True
        logger = setup_logging(run_dir, ctx.rank)
        if LAUNCHER_PID_ENV in os.environ:  # `distrain train` started it: see observe/logs.py
            native.enter_context(native_stderr_to(run_dir / "logs" / f"rank{ctx.rank}.log"))
        if changed:
            logger.info(
                "config: %d field(s) changed since this run dir's previous start: %s",
                len(changed),
                "; ".join(changed),
            )
        logger.info(
            "rank %d/%d on %s (%s), %d CPU thread(s)",
            ctx.rank,
            ctx.world_size,
            ctx.device,
            ctx.backend,
            torch.get_num_threads(),
        )
        trainer = build_trainer(resolve(config, ctx.device, ctx.world_size, logger), ctx, logger)
        if config.watchdog.hang_timeout_s:
            watchdog = start_watchdog(
                run_dir,
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout_s=config.watchdog.hang_timeout_s,
                logger=logger,
                nccl=nccl,
            )
        trainer.run()
        ended_well = True
    except DistrainError as e:
        if logger is not None:  # the one-line error reaches stderr once, from main or launcher
            logger.error("%s", e, extra=FILE_ONLY)
        failed_start = not isinstance(e, RunDirBusy) and (trainer is None or not trainer.started)
        _drop_frames(e)
        raise
    except BaseException as e:
        if logger is not None:
            logger.error("unexpected error, traceback follows", exc_info=e, extra=FILE_ONLY)
            # One line to the launcher now, before the teardown: the launcher names every rank
            # that failed alike once, rather than each printing its traceback.
            if isinstance(e, Exception) and report_unexpected(e):
                with contextlib.suppress(AttributeError):
                    e._distrain_reported = True  # type: ignore[attr-defined]
        _drop_frames(e)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if trainer is not None:
            trainer.close()
        if logger is not None:
            close_logging(logger)
        never_trained = trainer is None or not trainer.started
        del trainer
        teardown(synchronize=ended_well)
        if failed_start:
            footprint.remove()
        elif wrote_config and not ended_well and never_trained:
            footprint.restore_config()  # whatever ended a start that never trained
        if lock is not None:
            lock.release()
        native.close()


def _changes_since_last_start(path: Path, now: dict) -> list[str]:
    """What the config `now` (`Config.to_dict`) changes in the run dir's config.toml (none for a
    first start, or one that cannot be read: it is rewritten anyway)."""
    import tomllib

    try:
        return config_changes(tomllib.loads(path.read_text()), now)
    except (OSError, ValueError):
        return []


def _drop_frames(error: BaseException) -> None:
    """Free the locals of the frames `error` unwound (the trainer among them) now, before the
    process groups are destroyed, rather than whenever the exception object goes."""
    traceback.clear_frames(error.__traceback__)


def main(argv: list[str] | None = None) -> int:
    try:
        _, cfg = parse_train_args(sys.argv[1:] if argv is None else argv, worker=True)
        run_training(cfg)
    except DistrainError as e:
        if not report(e):
            print(f"distrain: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if getattr(e, "_distrain_reported", False):
            return 1  # its line reached the launcher, its traceback the rank's log
        raise
    return 0
