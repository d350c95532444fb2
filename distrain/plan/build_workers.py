"""Fake builds in worker processes: `Pool`, the build workers of search.plan (which builds they
make, and when: build_sharing.py).

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
import threading
from collections.abc import Callable, Iterable
from typing import Any


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
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable, tuple]] = []

    def start_soon(self) -> None:
        """Start the processes in the background: making a pool waits for the forkserver to
        import its preload (seconds), which this process need not wait for."""
        if self._pool is None and self._starting is None:
            self._starting = threading.Thread(target=self._start, daemon=True)
            self._starting.start()

    def started(self) -> bool:
        """Whether the processes are started or on their way (`start_soon`)."""
        return self._pool is not None or self._starting is not None

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
        pool = context.Pool(self.workers)
        with self._lock:
            for function, args in self._queued:
                pool.apply_async(function, args)
            self._queued = []
            self._pool = pool

    def submit_soon(self, function: Callable, args: tuple) -> None:
        """`function(*args)` in a worker, after the jobs given before it: sent at once when
        the processes are started, else once they are (`start_soon` starts them)."""
        with self._lock:
            if self._pool is None:
                self._queued.append((function, args))
                return
        self._pool.apply_async(function, args)

    def discard(self) -> None:
        """Stop the processes now, their jobs unfinished (the pool is started again when next
        used)."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        with self._lock:
            self._queued = []
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

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
