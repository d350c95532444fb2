"""Checkpoints: sharded DCP saves in <checkpoint dir>/step-<NNNNNNNN>/, committed by a manifest.

Protocol (the same for a local folder and an object store):
1. every rank writes its DCP shards (synchronously, or in a background thread with `async`);
2. when its part is written, each rank records the size and SHA-256 of the files it wrote in a
   small `rank<N>.json` beside them;
3. rank 0, once every rank's record is there, writes MANIFEST.json (files, sizes, checksums,
   step, kind, world size, layout, versions) last and atomically. Only then does the checkpoint
   exist for resume, and only then does retention delete older temporary checkpoints.
Resume takes the newest checkpoint whose manifest verifies; a torn, truncated or corrupted one is
reported and skipped. Loading never unpickles arbitrary objects: DCP's metadata goes through an
allow-list unpickler and byte entries through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

import distrain
from distrain.config import Config
from distrain.errors import CheckpointError
from distrain.storage import Storage
from distrain.torch_compat import dcp_metadata_path, set_nested_element

MANIFEST = "MANIFEST.json"
STEP_PREFIX = "step-"
DCP_METADATA = ".metadata"


def checkpoint_storage(cfg: Config) -> Storage:
    """Where a run's checkpoints live: checkpoint.dir, or <run_dir>/checkpoints by default."""
    return Storage(cfg.checkpoint.dir or str(Path(cfg.run.dir) / "checkpoints"))


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _step_of(name: str) -> int | None:
    suffix = name.removeprefix(STEP_PREFIX)
    return int(suffix) if name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def _rank_record(rank: int) -> str:
    return f"rank{rank}.json"


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint."""

    step: int
    path: str
    manifest: dict[str, Any]

    @property
    def permanent(self) -> bool:
        return self.manifest.get("kind") == "permanent"


def committed(storage: Storage) -> list[Entry]:
    """Every checkpoint with a manifest, oldest first (not yet verified)."""
    found = []
    for name in storage.listdir():
        step = _step_of(name)
        path = storage.path(name)
        if step is None or not storage.exists(f"{path}/{MANIFEST}"):
            continue
        try:
            manifest = json.loads(storage.read_text(f"{path}/{MANIFEST}"))
        except (OSError, ValueError):
            manifest = {"unreadable": True}
        found.append(Entry(step, path, manifest))
    return sorted(found, key=lambda e: e.step)


def verify(storage: Storage, entry: Entry) -> str | None:
    """None if every file the manifest lists is there with its size and checksum, else why not."""
    files = entry.manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest unreadable or lists no files"
    for name, info in sorted(files.items()):
        path = f"{entry.path}/{name}"
        if not storage.exists(path):
            return f"{name} is missing"
        if storage.size(path) != info["size"]:
            return f"{name} has {storage.size(path)} bytes, manifest says {info['size']}"
        if storage.sha256(path) != info["sha256"]:
            return f"{name} fails its SHA-256 checksum"
    return None


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


def _safe_reader(storage: Storage, path: str) -> Any:
    """A DCP reader for `path` whose metadata is read through the allow-list unpickler."""
    base = storage.dcp_reader_class()

    class SafeReader(base):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            meta_path = dcp_metadata_path(self, kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as stream:
                metadata = _AllowListUnpickler(io.BytesIO(stream.read())).load()
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(storage.reader_path(path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor entries load with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_nested_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(storage: Storage, path: str, state: dict[str, Any], *, partial: bool = False) -> None:
    """Load the checkpoint at `path` into `state` in place (resharding to the current layout)."""
    try:
        dcp.load(
            state,
            storage_reader=_safe_reader(storage, path),
            planner=SafeLoadPlanner(allow_partial_load=partial),
        )
    # DCP wraps per-rank failures in CheckpointException (a BaseException); the cause is what the
    # user needs.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {storage.url_of(path)} is corrupt or unreadable ({_root_cause(e)}); "
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


class Checkpointer:
    """Saves (sync or async, at most one in flight), commits, prunes and restores checkpoints."""

    def __init__(
        self,
        storage: Storage,
        *,
        layout: str,
        async_mode: bool,
        keep_temporary: int,
        logger: logging.Logger,
    ):
        self.storage, self.layout, self.async_mode = storage, layout, async_mode
        self.keep_temporary, self.log = keep_temporary, logger
        self.rank, self.world_size = _rank(), _world()
        # Background saves get their own gloo group: a collective of theirs interleaved with the
        # training group's would abort the process (gloo has no mismatch error, only SIGABRT).
        self.group = (
            dist.new_group(backend="gloo") if async_mode and dist.is_initialized() else None
        )
        # The save in flight: its step, the event set once this rank's record is written (done
        # callbacks run after result() returns, so waiting on the future alone is not enough).
        self.pending: tuple[int, threading.Event, Future] | None = None
        self.uncommitted: dict[int, tuple[str, str]] = {}  # rank 0: step -> (path, kind)

    # --- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, permanent: bool) -> None:
        """Collective. Returns once the state is captured (async) or written (sync)."""
        self.wait()
        kind = "permanent" if permanent else "temporary"
        path = self.storage.path(step_name(step))
        if self.rank == 0:
            self.storage.remove(path)  # a torn save of this step from an earlier attempt
            self.storage.makedirs(path)
        _barrier()
        writer = self.storage.dcp_writer(path)
        start = time.perf_counter()
        if self.async_mode:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            recorded = threading.Event()

            def record(done: Future, path: str = path) -> None:
                try:
                    self._record_part(path, done)
                finally:
                    recorded.set()

            future.add_done_callback(record)
            self.pending = (step, recorded, future)
        else:
            try:
                dcp.save(state, storage_writer=writer)
            except (Exception, CheckpointException) as e:
                self.log.error("checkpoint step %d failed, not committed: %s", step, _root_cause(e))
                return
            self._record_part(path, None)
        if self.rank == 0:
            self.uncommitted[step] = (path, kind)
        self.log.info(
            "checkpoint step %d (%s) %s in %.2fs",
            step,
            kind,
            "captured" if self.async_mode else "written",
            time.perf_counter() - start,
        )
        if not self.async_mode:
            _barrier()
            self.commit_ready()
            _barrier()

    def _record_part(self, path: str, future: Future | None) -> None:
        """Write this rank's file record once its part is on storage (in the saving thread for
        async saves). A failed save writes none, so it can never be committed."""
        if future is not None and future.exception() is not None:
            self.log.error(
                "async checkpoint %s failed, not committed: %s",
                path,
                _root_cause(future.exception()),
            )
            return
        prefix = f"__{self.rank}_"
        files = {}
        for name in self.storage.listdir(path):
            if name.startswith(prefix) or (self.rank == 0 and name == DCP_METADATA):
                full = f"{path}/{name}"
                files[name] = {"size": self.storage.size(full), "sha256": self.storage.sha256(full)}
        self.storage.write_text_atomic(f"{path}/{_rank_record(self.rank)}", json.dumps(files))

    def commit_ready(self) -> None:
        """Rank 0, no collective: commit every save whose ranks have all recorded their part,
        then apply retention. Cheap enough to call at every logging step."""
        if self.rank != 0:
            return
        for step, (path, kind) in sorted(self.uncommitted.items()):
            names = set(self.storage.listdir(path))
            if not all(_rank_record(r) in names for r in range(self.world_size)):
                continue
            files: dict[str, Any] = {}
            for r in range(self.world_size):
                files.update(json.loads(self.storage.read_text(f"{path}/{_rank_record(r)}")))
            manifest = {
                "step": step,
                "kind": kind,
                "world_size": self.world_size,
                "layout": self.layout,
                "distrain_version": distrain.__version__,
                "torch_version": torch.__version__,
                "time": time.time(),
                "files": files,
            }
            write_manifest(self.storage, path, manifest)
            del self.uncommitted[step]
            self.log.info("checkpoint %s committed", self.storage.url_of(path))
            self.prune()

    def prune(self) -> None:
        """Keep the newest `keep_temporary` temporary checkpoints and every permanent one; drop
        torn saves older than the newest committed checkpoint. Only ever after a commit."""
        entries = committed(self.storage)
        temporary = [e for e in entries if not e.permanent]
        for entry in temporary[: max(0, len(temporary) - self.keep_temporary)]:
            self.storage.remove(entry.path)
            self.log.info("retention: removed temporary checkpoint step %d", entry.step)
        newest = entries[-1].step if entries else -1
        kept = {e.step for e in entries}
        for name in self.storage.listdir():
            step = _step_of(name)
            if (
                step is not None
                and step < newest
                and step not in kept
                and step not in self.uncommitted
            ):
                self.storage.remove(self.storage.path(name))

    def wait(self) -> None:
        """Collective: finish the save in flight (if any) and commit it."""
        if self.pending is not None:
            step, recorded, future = self.pending
            self.pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                self.log.error("async checkpoint step %d failed: %s", step, _root_cause(e))
            recorded.wait()
        _barrier()
        self.commit_ready()
        _barrier()

    # --- restoring ---------------------------------------------------------------------------

    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Collective. Load the newest checkpoint that verifies; returns its step, or None."""
        for entry in reversed(committed(self.storage)):
            problem = self._agree(verify(self.storage, entry) if self.rank == 0 else None)
            if problem is not None:
                self.log.warning(
                    "checkpoint %s is damaged (%s); skipping it for the previous one",
                    self.storage.url_of(entry.path),
                    problem,
                )
                continue
            load(self.storage, entry.path, state)
            return entry.step
        return None

    def _agree(self, value: str | None) -> str | None:
        """Rank 0's verdict on every rank (verification reads the files once, on rank 0)."""
        if not dist.is_initialized() or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def corrupt_one_shard(storage: Storage, step: int) -> str:
    """Fault injection (debug.corrupt_checkpoint_step): flip the first byte of one shard file of
    a committed checkpoint, as bit rot or a bad disk would. Returns the damaged file."""
    path = storage.path(step_name(step))
    shard = next(n for n in storage.listdir(path) if n.endswith(".distcp"))
    data = bytearray(storage.fs.cat_file(f"{path}/{shard}"))
    data[0] ^= 0xFF
    storage.fs.pipe_file(f"{path}/{shard}", bytes(data))
    return f"{path}/{shard}"


def write_manifest(storage: Storage, path: str, manifest: dict[str, Any]) -> None:
    """The commit point: nothing refers to a checkpoint before its manifest exists."""
    storage.write_text_atomic(f"{path}/{MANIFEST}", json.dumps(manifest, indent=1))
