"""The memory model's calibration builds of several families at once, in worker processes.

A fake build is single-threaded Python (fake tensors have no data to compute on), so on a
machine of n cores n families calibrate in the time of one. The workers are forked from a
forkserver that imports this module, and with it torch and the planner, once: each starts in
milliseconds, and none inherits the threads of the calling process (a test process's gloo or
OpenMP threads, which a plain fork would copy in whatever state they were in).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable, Iterable

from distrain.config.schema import Config
from distrain.plan.memory import MemoryEstimate
from distrain.plan.memory_model import Coefficients, Family, calibrate_family

Measure = Callable[[Config, int, dict], MemoryEstimate]
"""search.memory_of: a fake build of (config, world size) through a cache of builds."""


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def calibrate_families(
    base: Config, families: Iterable[Family], measure: Measure, *, workers: int
) -> dict[Family, Coefficients | Exception]:
    """Each family's coefficients, or the error its builds raised (the rows it prices report
    it), calibrated by up to `workers` processes (1: in this process)."""
    unique = list(dict.fromkeys(families))
    workers = min(workers, len(unique))
    jobs = [(base, family, measure) for family in unique]
    if workers <= 1:
        return dict(zip(unique, (_calibrate(*job) for job in jobs), strict=True))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with context.Pool(workers) as pool:
        found = pool.starmap(_calibrate, jobs, chunksize=1)
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
