"""Checkpoints: sharded DCP saves in <run_dir>/checkpoints/step-<NNNNNNNN>/, committed by a marker.

A checkpoint counts only once its COMPLETE marker exists. The marker is written by rank 0 after
every rank has finished writing (and after DCP's own metadata), via a temporary file renamed into
place, so a crash at any moment leaves either a complete checkpoint or one that resume ignores.
Loading never unpickles arbitrary objects: DCP's metadata goes through an allow-list unpickler and
byte entries through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from distrain.errors import CheckpointError

MARKER = "COMPLETE"
STEP_PREFIX = "step-"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix(STEP_PREFIX)
    return int(suffix) if path.name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = _step_of(path)
        if step is not None and (path / MARKER).is_file():
            found.append((step, path))
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its own dataclasses, torch dtypes/sizes and plain containers."""

    _builtins = {
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "slice",
        "int",
        "float",
        "str",
        "bytes",
    }
    _extras = {
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided & co.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (
                module == "torch"
                and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "builtins" and name in self._builtins)
            or (module, name) in self._extras
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _AllowListUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor entries load with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def save(root: Path, step: int, state: dict[str, Any], *, world_size: int) -> Path:
    """Write a checkpoint collectively (every rank calls this) and commit it with the marker."""
    path = step_dir(root, step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if path.exists():  # a torn save of the same step from an earlier attempt
            shutil.rmtree(path)
        path.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, storage_writer=FileSystemWriter(str(path)))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        write_marker(path, {"step": step, "world_size": world_size, "time": time.time()})
    if dist.is_initialized():
        dist.barrier()
    return path


def write_marker(path: Path, info: dict[str, Any]) -> None:
    tmp = path / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER)


def load(path: Path, state: dict[str, Any], *, partial: bool = False) -> None:
    """Load `path` into `state` in place (resharding to the current layout as needed)."""
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(allow_partial_load=partial),
        )
    # DCP wraps per-rank failures in CheckpointException (a BaseException); the cause is what the
    # user needs.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({_root_cause(e)}); "
            "delete it or resume from an earlier one"
        ) from e


def _root_cause(error: BaseException) -> str:
    """The first rank's underlying exception, as one short line."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
        if isinstance(error, AssertionError) and "; " in str(error):  # DCP's metadata read summary
            return " ".join(str(error).split())[:300]
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:300]}"
