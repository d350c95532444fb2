"""The planner's fake builds kept on disk, so that a plan asked again (or another plan of the
same model) reads them instead of building again.

One JSON file per build under the planner's cache directory (calibrate.cache_dir()/builds),
named by a digest of everything the build's result depends on: which build it is (the type of
its result: memory.py's MemoryEstimate, pipeline_memory.py's PipelineMemory), the whole config of
its RunPlan (planned.py), the world size and rank, torch's version, and the source of the
distrain package (a changed model, layout or planner makes every older file a miss; nothing is
ever read back for other code);
other builds (`keep`: parameter_table.py's meta build) name what they depend on themselves.
A build that raises is not stored: the next plan tries it again. The cache is data another
process could have written: a stored build is read only from a regular file (a symlink is not
followed), of at most MAX_FILE_BYTES, holding exactly the result's fields, each an integer (a
result type with `from_stored` checks its own JSON, of at most its MAX_STORED_BYTES, and writes
it with `to_stored`); anything else is a miss and is written again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from distrain.parallel.run_plan import RunPlan

Result = TypeVar("Result")
MAX_FILE_BYTES = 4096
"""A stored build is a handful of integers: a bigger file is not one."""


def read_stored_json(path: Path, limit: int) -> object:
    """The JSON of the regular file at `path` (a symlink is not followed) of at most `limit`
    bytes; OSError (FileNotFoundError when there is none) or ValueError when it is not that."""
    # O_NONBLOCK: a FIFO at the name is refused below, not waited on for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        text = f.read(limit + 1)
    if len(text) > limit:
        raise ValueError(f"{path} is not a file of at most {limit} bytes")
    try:
        return json.loads(text)
    except RecursionError as error:  # nested deeper than the interpreter's stack
        raise ValueError(f"{path} is nested too deeply") from error


def _read(path: Path, result_type: type[Result]) -> Result:
    """The stored build at `path`; OSError or ValueError when it is not one (module docstring)."""
    fields = read_stored_json(path, getattr(result_type, "MAX_STORED_BYTES", MAX_FILE_BYTES))
    if hasattr(result_type, "from_stored"):
        return result_type.from_stored(fields)
    names = {f.name for f in dataclasses.fields(result_type)}  # type: ignore[arg-type]
    if not isinstance(fields, dict) or set(fields) != names:
        raise ValueError(f"{path} does not hold the fields of {result_type.__name__}")
    if not all(type(v) is int for v in fields.values()):
        raise ValueError(f"{path} holds a value that is not an integer")
    return result_type(**fields)


def _holds(path: Path, result_type: type) -> bool:
    try:
        _read(path, result_type)
    except (OSError, ValueError):
        return False
    return True


@functools.cache
def code_digest() -> str:
    """sha256 of torch's version and every source file of the distrain package (this file's
    grandparent folder)."""
    digest = hashlib.sha256(torch.__version__.encode())
    package = Path(__file__).resolve().parents[1]  # the distrain package
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class BuildStore:
    """The builds stored in `directory` (made when the first is written)."""

    directory: Path

    def path(self, result_type: type, plan: RunPlan, rank: int = 0) -> Path:
        world_size = plan.dims.world_size
        key = {"config": dataclasses.asdict(plan.config), "world_size": world_size, "rank": rank}
        return self._path(result_type, key)

    def _path(self, result_type: type, key: dict) -> Path:
        what = {
            "build": f"{result_type.__module__}.{result_type.__qualname__}",
            **key,
            "code": code_digest(),
        }
        text = json.dumps(what, sort_keys=True, default=str)
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()}.json"

    def has(self, result_type: type, plan: RunPlan, rank: int = 0) -> bool:
        """Whether `build` would read the build back (the same checks as its read)."""
        return _holds(self.path(result_type, plan, rank), result_type)

    def has_kept(self, result_type: type, key: dict) -> bool:
        """Whether `keep` would read the build of `key` back (the same checks as its read)."""
        return _holds(self._path(result_type, key), result_type)

    def build(
        self,
        estimate: Callable[..., Result],
        result_type: type[Result],
        plan: RunPlan,
        *,
        rank: int = 0,
    ) -> Result:
        """`estimate(plan, rank=rank)` (a fake build: a dataclass of ints), read from its file
        when stored, else run and stored."""
        path = self.path(result_type, plan, rank)
        return self._kept(path, result_type, lambda: estimate(plan, rank=rank))

    def keep(self, result_type: type[Result], key: dict, make: Callable[[], Result]) -> Result:
        """`make()`, a build of `result_type` whose result depends on `key` (JSON) and this
        code alone, read from its file when stored, else run and stored."""
        return self._kept(self._path(result_type, key), result_type, make)

    def _kept(self, path: Path, result_type: type[Result], make: Callable[[], Result]) -> Result:
        try:
            return _read(path, result_type)
        except (OSError, ValueError):
            pass
        found = make()
        stored = found.to_stored() if hasattr(found, "to_stored") else dataclasses.asdict(found)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Written whole under another name, then renamed: a plan running beside this one reads
        # the old file, the new one or none, never half of one.
        fd, partial = tempfile.mkstemp(dir=self.directory, suffix=".partial")
        with os.fdopen(fd, "w") as out:
            json.dump(stored, out)
        os.replace(partial, path)
        return found


def build(
    store: BuildStore | None,
    estimate: Callable[..., Result],
    result_type: type[Result],
    plan: RunPlan,
    *,
    rank: int = 0,
) -> Result:
    """`estimate(plan, rank=rank)` through `store`, or run when there is none."""
    if store is None:
        return estimate(plan, rank=rank)
    return store.build(estimate, result_type, plan, rank=rank)
