"""Fake builds in worker processes: `Pool`, the build workers of search.plan (a family's
calibration or a verified layout's two depths at once), and `calibrate_families`, several
families' calibrations at once.

A fake build is single-threaded Python (fake tensors have no data to compute on), so on a
machine of n cores n builds take the time of one. The workers are forked from a forkserver
that imports this module, and with it torch and the planner, once (and what else `Pool` is
given to preload): each starts in milliseconds, and none inherits the threads of the calling
process (a test process's gloo or OpenMP threads, which a plain fork would copy in whatever
state they were in). A plan keeps one `Pool` for all its builds, so each worker pays its first
build's one-time costs once.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable, Iterable
from typing import Any

from distrain.config.schema import Config
from distrain.plan.memory import MemoryEstimate
from distrain.plan.memory_model import Coefficients, Family, calibrate_family

Measure = Callable[[Config, int, dict], MemoryEstimate]
"""search.memory_of: a fake build of (config, world size) through a cache of builds."""


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


class Pool:
    """Up to `workers` calibration processes, started when first used and kept until `close`
    (or the end of a `with` block)."""

    def __init__(self, workers: int, *, preload: Iterable[str] = ()) -> None:
        self.workers = workers
        self.preload = [__name__, *preload]
        self._pool: Any = None
        self._starting: threading.Thread | None = None

    def start_soon(self) -> None:
        """Start the processes in the background: making a pool waits for the forkserver to
        import its preload (seconds), which this process need not wait for."""
        if self._pool is None and self._starting is None:
            self._starting = threading.Thread(target=self._start, daemon=True)
            self._starting.start()

    def ready(self) -> bool:
        """Whether the processes are started and take jobs at once."""
        return self._pool is not None

    def start(self) -> Any:
        """The processes (started now when they are not yet): a multiprocessing pool."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._pool is None:
            self._start()
        return self._pool

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(self.preload)
        self._pool = context.Pool(self.workers)

    def starmap(self, function: Callable, jobs: list[tuple]) -> list:
        return self.start().starmap(function, jobs, chunksize=1)

    def submit(self, function: Callable, args: tuple) -> Any:
        """`function(*args)` in a worker, at once: its AsyncResult."""
        return self.start().apply_async(function, args)

    def close(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if exc[0] is not None and self._pool is not None:
            self._pool.terminate()
        self.close()


def calibrate_families(
    base: Config,
    families: Iterable[Family],
    measure: Measure,
    *,
    workers: int,
    pool: Pool | None = None,
) -> dict[Family, Coefficients | Exception]:
    """Each family's coefficients, or the error its builds raised (the rows it prices report
    it), calibrated by up to `workers` processes (1: in this process); `pool`: the processes
    of an earlier batch, kept (a new pool, closed after, without it)."""
    unique = list(dict.fromkeys(families))
    workers = min(workers, len(unique))
    jobs = [(base, family, measure) for family in unique]
    if workers <= 1:
        return dict(zip(unique, (_calibrate(*job) for job in jobs), strict=True))
    if pool is not None:
        found = pool.starmap(_calibrate, jobs)
    else:
        with Pool(workers) as own:
            found = own.starmap(_calibrate, jobs)
    return dict(zip(unique, found, strict=True))


def _calibrate(base: Config, family: Family, measure: Measure) -> Coefficients | Exception:
    cache: dict = {}
    try:
        return calibrate_family(base, family, lambda cfg, world: measure(cfg, world, cache))
    except Exception as error:  # noqa: BLE001 - returned to the rows the family prices
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an error that cannot cross to the caller
            return RuntimeError(f"{type(error).__name__}: {error}")
        return error
