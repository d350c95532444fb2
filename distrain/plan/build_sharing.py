"""The fake builds of one plan shared between its process and its build workers
(build_workers.Pool): each made once, by whichever process claims it first.

The planning process asks for the builds it needs now (`SharedBuilds.now`: a family's
calibration, a verified layout's two depths) and names the ones it will likely need next
(`ahead`: the calibrations of the next families its walk meets). Both are sent to the workers,
which take them in order; the planning process makes each build of `now` that no worker has
begun, and waits only for those a worker is making. So the workers make the builds the walk is
about to need while the planning process makes its own, and the planning process never waits
behind a build it does not need.

A claim is a file made with O_EXCL in a directory of this plan's (the claimant's pid in it), a
build's end a second file; a claimant that died without ending its build (a killed worker) is
not waited for: the planning process's own call then makes it. When the plan is done
(`close`), the builds still queued are dropped: a worker reads the stop file before it claims
and again after, and builds only if the plan was not done by then.
The builds are kept in the plan's BuildStore, which the planning process reads them back from.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from distrain.launch.rundir import pid_alive
from distrain.parallel.run_plan import RunPlan
from distrain.plan.build_store import BuildStore
from distrain.plan.build_workers import Pool
from distrain.plan.built_rows import build_key, kept, memory_of, memory_row

Call = tuple[Callable, RunPlan]
"""memory_of or memory_row, of a layout."""
POLL_S = 0.01
STOP = "stop"


def _name(function: Callable, plan: RunPlan) -> str:
    what = repr((function.__name__, build_key(function, plan), plan.dims.world_size))
    return hashlib.sha256(what.encode()).hexdigest()


def _claim(claims: Path, name: str) -> bool:
    """Whether this process now holds `name` (no other process claimed it first)."""
    path = claims / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except (FileExistsError, FileNotFoundError):  # claimed, or the plan is done
        return False
    with os.fdopen(fd, "w") as out:
        out.write(str(os.getpid()))
    return True


def _stopped(claims: Path) -> bool:
    """Whether the plan is done (`close` marked it, or moved the folder away)."""
    return (claims / STOP).exists() or not claims.is_dir()


def _end(claims: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # the plan is done
        (claims / f"{name}.done").touch()


def _await(claims: Path, name: str) -> None:
    """Until the build claimed as `name` has ended, or its claimant died."""
    while not (claims / f"{name}.done").exists():
        try:
            pid = int((claims / name).read_text())
        except (OSError, ValueError):  # being written: its claimant is alive
            pid = os.getpid()
        if not pid_alive(pid):
            return
        time.sleep(POLL_S)


def make_claimed(function: str, plan: RunPlan, store: BuildStore, claims: str) -> None:
    """A worker's job: `function` (memory_of or memory_row) of `plan`, its fake builds kept in
    `store`, unless the plan is done or another process claimed it. One that fails is not
    kept: the planning process makes it again, and reports its error."""
    folder = Path(claims)
    made = {"memory_of": memory_of, "memory_row": memory_row}[function]
    name = _name(made, plan)
    if _stopped(folder) or not _claim(folder, name):
        return
    try:
        # Stopped between the check and the claim: `close` may have listed the claims before
        # this one was made, and does not wait for it.
        if not _stopped(folder):
            made(plan, {}, store=store)
    except Exception:  # noqa: BLE001, S110 - not kept: the planning process builds it again
        pass
    finally:
        _end(folder, name)


class SharedBuilds:
    """A plan's builds, made by this process and `pool`'s workers into `store`."""

    def __init__(self, pool: Pool, store: BuildStore, *, discard: bool = False) -> None:
        self.pool = pool
        self.store = store
        self.discard = discard
        self.claims = Path(tempfile.mkdtemp(prefix="distrain-plan-claims-"))
        self._sent: set[str] = set()

    def ahead(self, calls: Iterable[Call]) -> None:
        """Send the workers `calls` (builds the plan will likely need) not sent or kept yet,
        once they are started (`now` starts them: a plan that needs no build starts none)."""
        if not self.pool.started():
            return
        for function, plan in calls:
            name = _name(function, plan)
            if name in self._sent or kept(function, plan, self.store):
                continue
            self._sent.add(name)
            args = (function.__name__, plan, self.store, str(self.claims))
            self.pool.submit_soon(make_claimed, args)

    def now(self, calls: list[Call], cache: dict, then: Iterable[Call] = ()) -> None:
        """Make the builds of `calls` not made yet: those no worker has begun here (into
        `cache` and the store), waiting for the others; the workers are sent them, then
        `then` (`ahead`). One that fails here is left for the caller's own call to report."""
        todo = [c for c in calls if build_key(*c) not in cache and not kept(*c, self.store)]
        if todo:
            self.pool.start_soon()
        self.ahead(todo[1:])  # a free worker takes them
        self.ahead(then)
        begun = []
        for function, plan in todo:
            name = _name(function, plan)
            if not _claim(self.claims, name):
                begun.append(name)
                continue
            try:
                function(plan, cache, store=self.store)
            except Exception:  # noqa: BLE001, S110 - the caller's own call reports it
                pass
            finally:
                _end(self.claims, name)
        for name in begun:
            _await(self.claims, name)

    def close(self) -> None:
        """Drop the builds still queued (a worker that takes one returns at once) and wait for
        those a worker is making; with `discard`, stop the pool's processes instead, their
        builds unfinished (none is kept half-written: build_store.py)."""
        (self.claims / STOP).touch()
        if self.discard:
            self.pool.discard()
        for claim in self.claims.iterdir():
            if claim.name != STOP and not claim.name.endswith(".done"):
                _await(self.claims, claim.name)
        # Moved away first: a worker that claims from now on finds no folder and builds nothing.
        closed = self.claims.with_name(self.claims.name + ".closed")
        self.claims.rename(closed)
        while True:
            try:
                shutil.rmtree(closed)
                return
            except OSError as err:  # a claim made as the folder moved, ended at once
                if err.errno != errno.ENOTEMPTY:
                    raise

    def __enter__(self) -> SharedBuilds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
