"""Checkpoints: sharded DCP saves in <checkpoint dir>/step-<NNNNNNNN>/, committed by a manifest.

Protocol (the same for a local folder and an object store):
1. every rank writes its DCP shards (synchronously, or in a background thread with `async`),
   hashing each file's bytes as they go out (storage.HashingWriter: nothing is read back);
2. when its part is written, each rank records the size and SHA-256 of the files it wrote in a
   small `rank<N>.json` beside them;
3. rank 0, once every rank's record is there, writes MANIFEST.json (files, sizes, checksums,
   step, kind, world size, layout, versions) last and atomically. Only then does the checkpoint
   exist for resume, and only then does retention delete older temporary checkpoints.
A save that fails on any rank fails on all: its directory is removed and the cause reported in
one line; too many failures in a row stop the run. Resume takes the newest checkpoint whose
manifest verifies (every rank hashing a share of its files); a torn, truncated or corrupted one
is reported and skipped. Loading (checkpoint_load.py) never unpickles arbitrary objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import distrain
from distrain.checkpoint_load import load, root_cause
from distrain.config import Config
from distrain.errors import CheckpointError
from distrain.mesh import checkpoint_group
from distrain.observe import heartbeat
from distrain.save_attempt import Attempt, disk_full, mb_text
from distrain.storage import HashingWriter, Storage, StorageError, one_line

MANIFEST = "MANIFEST.json"
STEP_PREFIX = "step-"
DCP_METADATA = ".metadata"


def checkpoint_storage(cfg: Config) -> Storage:
    """Where a run's checkpoints live: checkpoint.dir, or <run_dir>/checkpoints by default.
    The bytes it moves are progress for the hang watchdog."""
    return Storage(
        cfg.checkpoint.dir or str(Path(cfg.run.dir) / "checkpoints"),
        retry_s=cfg.checkpoint.storage_retry_s,
        on_progress=heartbeat.moved,
    )


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
        """Never pruned: a permanent save, or a preempt save at a step a permanent one was due."""
        return bool(self.manifest.get("permanent", self.manifest.get("kind") == "permanent"))

    @property
    def kind(self) -> str:
        return self.manifest.get("kind", "temporary")


def scan(storage: Storage) -> tuple[list[Entry], list[str]]:
    """Every checkpoint with a manifest, oldest first (not yet verified), and the names of the
    step folders without one (torn saves, deleted manifests)."""
    found, torn = [], []
    for name in storage.listdir():
        step = _step_of(name)
        if step is None:
            continue
        path = storage.path(name)
        if not storage.exists(f"{path}/{MANIFEST}"):
            torn.append(name)
            continue
        try:
            manifest = json.loads(storage.read_text(f"{path}/{MANIFEST}"))
        except (OSError, ValueError):  # not StorageError: an unreachable store is no verdict
            manifest = {"unreadable": True}
        found.append(Entry(step, path, manifest))
    return sorted(found, key=lambda e: e.step), torn


def committed(storage: Storage) -> list[Entry]:
    """Every checkpoint with a manifest, oldest first (not yet verified)."""
    return scan(storage)[0]


def verify(storage: Storage, entry: Entry, names: list[str] | None = None) -> str | None:
    """None if the files `names` (default: all the manifest lists) are there with their size and
    checksum, else why not."""
    files = entry.manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest unreadable or lists no files"
    for name in sorted(files) if names is None else names:
        info = files[name]
        path = f"{entry.path}/{name}"
        if not storage.exists(path):
            return f"{name} is missing"
        if storage.size(path) != info["size"]:
            return f"{name} has {storage.size(path)} bytes, manifest says {info['size']}"
        if storage.sha256(path) != info["sha256"]:
            return f"{name} fails its SHA-256 checksum"
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class _Pending:
    """The async save in flight; `attempt` is set, then `recorded`, by the saving thread."""

    step: int
    path: str
    kind: str
    free_bytes: int | None
    future: Future
    recorded: threading.Event
    attempt: Attempt | None = None


class Checkpointer:
    """Saves (sync or async, at most one in flight), commits, prunes and restores checkpoints.

    A save that fails on any rank is failed on every rank: its directory is removed, the cause
    is logged as one line and passed to `on_failure`, and after `max_failed_saves` failures in a
    row `CheckpointError` stops the run (the newest committed checkpoint stays intact).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        layout: str,
        async_mode: bool,
        keep_temporary: int,
        logger: logging.Logger,
        max_failed_saves: int = 3,
        collective_timeout_s: float = 7200.0,
        on_failure: Callable[[int, str], None] | None = None,
    ):
        self.storage, self.layout, self.async_mode = storage, layout, async_mode
        self.keep_temporary, self.log = keep_temporary, logger
        self.max_failed_saves, self.on_failure = max_failed_saves, on_failure
        self.rank, self.world_size = _rank(), _world()
        self.group = checkpoint_group(collective_timeout_s)
        self.pending: _Pending | None = None
        # rank 0: step -> (path, kind, permanent)
        self.uncommitted: dict[int, tuple[str, str, bool]] = {}
        self.failed_in_a_row = 0
        self.newest_committed: int | None = None

    # --- collectives on the checkpoint group ---------------------------------------------------

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    # --- saving ------------------------------------------------------------------------------

    def save(
        self, step: int, state: dict[str, Any], *, permanent: bool, preempt: bool = False
    ) -> None:
        """Collective. Returns once the state is captured (async) or written and committed
        (sync). Raises CheckpointError once `max_failed_saves` saves in a row have failed.
        `preempt`: the save a stop signal asked for (kind "preempt", see `prune`); with
        `permanent` too it is also kept like a permanent one."""
        self.wait()
        kind = "preempt" if preempt else "permanent" if permanent else "temporary"
        path = self.storage.path(step_name(step))
        prepared: tuple[str | None, int | None] = (None, None)
        if self.rank == 0:
            try:
                self.storage.remove(path)  # a torn save of this step from an earlier attempt
                self.storage.makedirs(path)
                prepared = (None, self.storage.free_bytes())
            except Exception as e:
                prepared = (str(e) if isinstance(e, StorageError) else one_line(e), None)
        prep_error, free_bytes = self._broadcast(prepared)
        if prep_error is not None:
            self._settle(step, path, kind, Attempt(error=prep_error), free_bytes)
            return
        writer = self.storage.dcp_writer(path)
        start = time.perf_counter()
        if self.async_mode:
            try:
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            except (Exception, CheckpointException) as e:  # staging failed: nothing in flight
                self._settle(step, path, kind, self._finish_part(path, writer, e), free_bytes)
                return
            pending = _Pending(step, path, kind, free_bytes, future, threading.Event())

            def record(done: Future) -> None:
                try:
                    pending.attempt = self._finish_part(path, writer, done.exception())
                finally:
                    pending.recorded.set()

            future.add_done_callback(record)
            self.pending = pending
            if self.rank == 0:
                self.uncommitted[step] = (path, kind, permanent)
            self.log.info(
                "checkpoint step %d (%s) captured in %.2fs", step, kind, time.perf_counter() - start
            )
            return
        error: BaseException | None = None
        try:
            dcp.save(state, storage_writer=writer, process_group=self.group)
        except (Exception, CheckpointException) as e:
            error = e
        attempt = self._finish_part(path, writer, error)
        if attempt.error is None:
            self.log.info(
                "checkpoint step %d (%s) written in %.2fs", step, kind, time.perf_counter() - start
            )
            if self.rank == 0:
                self.uncommitted[step] = (path, kind, permanent)
        self._settle(step, path, kind, attempt, free_bytes)

    def _finish_part(
        self, path: str, writer: HashingWriter, error: BaseException | None
    ) -> Attempt:
        """This rank's verdict on its part; on success its file record (size and SHA-256 of
        each file, hashed while writing) goes beside the files. Runs in the saving thread for
        async saves, so it never raises."""
        if error is None:
            try:
                self.storage.write_text_atomic(
                    f"{path}/{_rank_record(self.rank)}", json.dumps(writer.written)
                )
            except Exception as e:
                error = e
        if error is None:
            return Attempt(planned_bytes=writer.planned_bytes)
        if isinstance(error, StorageError):
            cause = str(error)
        else:
            cause = (
                f"writing to {self.storage.url} failed on rank {self.rank} ({root_cause(error)})"
            )
        return Attempt(
            error=cause,
            disk_full=disk_full(error, writer),
            planned_bytes=writer.planned_bytes,
        )

    def _settle(
        self, step: int, path: str, kind: str, attempt: Attempt, free_bytes: int | None
    ) -> None:
        """Collective: combine every rank's attempt; commit the save if all succeeded, else
        remove it and count the failure."""
        attempts = self._all_gather(attempt)
        failed = [a for a in attempts if a.error is not None]
        commit_error = None
        if not failed:
            if self.rank == 0:
                try:
                    self._commit(step)
                except Exception as e:
                    commit_error = str(e) if isinstance(e, StorageError) else one_line(e)
            commit_error = self._broadcast(commit_error)
        if not failed and commit_error is None:
            self.failed_in_a_row = 0
            self.newest_committed = step
            return
        needed = sum(a.planned_bytes for a in attempts)
        if any(a.disk_full for a in attempts) or (free_bytes is not None and needed > free_bytes):
            free = "?" if free_bytes is None else mb_text(free_bytes)
            cause = f"disk full on {self.storage.url} ({free} MB free, {mb_text(needed)} MB needed)"
        else:
            cause = failed[0].error if failed else f"commit failed ({commit_error})"
        self._failed(step, path, f"checkpoint {step_name(step)} not saved: {cause}")

    def _failed(self, step: int, path: str, message: str) -> None:
        """A failed save on every rank: remove its files, report it, stop after too many."""
        self.uncommitted.pop(step, None)
        if self.rank == 0:
            try:
                self.storage.remove(path)
            except Exception as e:
                self.log.warning("could not remove the failed save %s: %s", path, one_line(e))
        self.failed_in_a_row += 1
        self.log.error("%s", message)
        if self.on_failure is not None:
            self.on_failure(step, message)
        if self.failed_in_a_row >= self.max_failed_saves:
            newest = "none" if self.newest_committed is None else step_name(self.newest_committed)
            raise CheckpointError(
                f"{message}; {self.failed_in_a_row} saves in a row failed "
                f"(checkpoint.max_failed_saves = {self.max_failed_saves}), stopping; newest "
                f"committed checkpoint: {newest}"
            )

    def _commit(self, step: int) -> None:
        """Rank 0: write the manifest of a save whose ranks have all recorded their part."""
        if step not in self.uncommitted:
            return  # committed already by commit_ready
        path, kind, permanent = self.uncommitted[step]
        files: dict[str, Any] = {}
        for r in range(self.world_size):
            files.update(json.loads(self.storage.read_text(f"{path}/{_rank_record(r)}")))
        manifest = {
            "step": step,
            "kind": kind,
            "permanent": permanent,
            "world_size": self.world_size,
            "layout": self.layout,
            "distrain_version": distrain.__version__,
            "torch_version": torch.__version__,
            "time": time.time(),
            "files": files,
        }
        write_manifest(self.storage, path, manifest)
        del self.uncommitted[step]
        self.newest_committed = step
        self.log.info("checkpoint %s committed", self.storage.url_of(path))
        self.prune()

    def commit_ready(self) -> None:
        """Rank 0, no collective: commit an async save whose ranks have all recorded their part,
        then apply retention. Cheap enough to call at every logging step; a storage error here
        is a warning (the collective `wait` settles the save for good)."""
        if self.rank != 0:
            return
        for step, (path, *_) in sorted(self.uncommitted.items()):
            try:
                names = set(self.storage.listdir(path))
                if all(_rank_record(r) in names for r in range(self.world_size)):
                    self._commit(step)
            except Exception as e:
                self.log.warning("checkpoint step %d not committed yet: %s", step, one_line(e))

    def prune(self) -> None:
        """Keep the newest `keep_temporary` temporary checkpoints and every permanent one; drop
        torn saves older than the newest committed checkpoint. Only ever after a commit, and
        never fatal: a storage error leaves the files for the next prune and logs a warning. A
        preempt checkpoint is what the next start resumes from: kept while it is the newest,
        counted as temporary once a later one is committed."""
        try:
            self._prune()
        except Exception as e:
            self.log.warning(
                "retention skipped on %s: %s", self.storage.url, str(e).splitlines()[0][:400]
            )

    def _prune(self) -> None:
        entries = committed(self.storage)
        temporary = [
            e for e in entries if not e.permanent and not (e.kind == "preempt" and e is entries[-1])
        ]
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
        """Collective: finish the async save in flight (if any) and settle it (commit, or count
        it as failed)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with contextlib.suppress(Exception, CheckpointException):
            pending.future.result()  # its exception, if any, is in pending.attempt
        pending.recorded.wait()
        attempt = pending.attempt or Attempt(error="the save thread ended without a verdict")
        self._settle(pending.step, pending.path, pending.kind, attempt, pending.free_bytes)

    # --- restoring ---------------------------------------------------------------------------

    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Collective. Load the newest checkpoint that verifies; returns its step, or None.
        Rank 0 lists the candidates; every rank verifies a share of each one's files."""
        found: tuple[list[Entry], list[str], str | None] = ([], [], None)
        if self.rank == 0:
            try:
                found = (*scan(self.storage), None)
            except Exception as e:
                found = ([], [], str(e) if isinstance(e, StorageError) else one_line(e))
        entries, torn, error = self._broadcast(found)
        if error is not None:
            raise CheckpointError(
                f"cannot list checkpoints under {self.storage.url}: {error}; resuming is "
                "impossible until the storage answers"
            )
        for name in torn:
            self.log.warning(
                "checkpoint %s is incomplete (no %s: its save never finished, or the manifest "
                "was deleted); ignoring it",
                self.storage.url_of(self.storage.path(name)),
                MANIFEST,
            )
        for entry in reversed(entries):
            problem = self._verify_shared(entry)
            if problem is not None:
                self.log.warning(
                    "checkpoint %s is damaged (%s); skipping it for the previous one",
                    self.storage.url_of(entry.path),
                    problem,
                )
                continue
            load(self.storage, entry.path, state, process_group=self.group)
            self.newest_committed = entry.step
            return entry.step
        return None

    def _verify_shared(self, entry: Entry) -> str | None:
        """Every rank checks every world_size-th file of `entry`; the first problem found (by
        rank) is everyone's verdict. A storage that cannot be read stops the resume instead:
        falling back to an older checkpoint for that would lose work for no reason."""
        files = entry.manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest unreadable or lists no files"
        share = sorted(files)[self.rank :: self.world_size]
        verdict: tuple[str | None, str | None] = (None, None)
        try:
            verdict = (verify(self.storage, entry, share), None)
        except Exception as e:
            verdict = (None, str(e) if isinstance(e, StorageError) else one_line(e))
        verdicts = self._all_gather(verdict)
        fatal = [v[1] for v in verdicts if v[1] is not None]
        if fatal:
            raise CheckpointError(
                f"cannot verify checkpoint {self.storage.url_of(entry.path)}: {fatal[0]}"
            )
        return next((v[0] for v in verdicts if v[0] is not None), None)


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
