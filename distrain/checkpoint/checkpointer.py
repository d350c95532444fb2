"""Checkpoints: sharded DCP saves in <checkpoint dir>/step-<NNNNNNNN>/, committed by a manifest
(the layout and the manifest: manifest.py).

Protocol (the same for a local folder and an object store):
1. every rank writes its DCP shards (synchronously, or in a background thread with `async`),
   hashing each file's bytes as they go out (storage.HashingWriter: nothing is read back);
2. when its part is written, each rank records the size and SHA-256 of the files it wrote in a
   small `rank<N>.json` beside them;
3. rank 0, once every rank's record is there, writes MANIFEST.json (files, sizes, checksums,
   step, kind, world size, layout, the state's notes, versions) last and atomically. Only then
   does the checkpoint exist for resume, and only then does retention delete older temporary
   checkpoints.
Every manifest names the run that wrote it (rundir.run_id); a run resumes only its own
checkpoints, and claims its checkpoint location (OWNER.json, ownership.py) so that a second run
sent there by mistake is refused before its first step rather than deleting the first one's
files.
A save that fails on any rank fails on all: its directory is removed and the cause reported in
one line; too many failures in a row stop the run. Which committed checkpoints are kept is
retention.py's; resuming from the newest one that verifies is restore.py's; the collectives of
both sides are group.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distrain.checkpoint.group import CheckpointGroup
from distrain.checkpoint.load import root_cause
from distrain.checkpoint.manifest import rank_record, step_name, write_manifest
from distrain.checkpoint.ownership import claim, owner_problem
from distrain.checkpoint.restore import Restorer
from distrain.checkpoint.retention import Retention
from distrain.checkpoint.save_attempt import Attempt, disk_full, mb_text
from distrain.checkpoint.storage import HashingWriter, Storage, StorageError, one_line
from distrain.config.schema import Config
from distrain.errors import CheckpointError, ConfigError
from distrain.observe import heartbeat


def checkpoint_storage(cfg: Config) -> Storage:
    """Where a run's checkpoints live: checkpoint.dir, or <run_dir>/checkpoints by default.
    The bytes it moves are progress for the hang watchdog."""
    return Storage(
        cfg.checkpoint.dir or str(Path(cfg.run.dir) / "checkpoints"),
        retry_s=cfg.checkpoint.storage_retry_s,
        on_progress=heartbeat.moved,
    )


def read_checkpoints_of(cfg: Config, run_dir: Path, checkpoint_dir: str | None) -> Config:
    """`cfg` (a run folder's config.toml) pointed at where a reading command (generate, export)
    takes the run's checkpoints from: `checkpoint_dir` when given, else the run's own location,
    which must lie inside the run folder. A run folder is data that anyone may have written: a
    checkpoint.dir elsewhere (another folder, a bucket) is read only when the user names it.
    `cfg` itself is not changed."""
    # The run may have moved since it was trained.
    run = dataclasses.replace(cfg.run, dir=str(run_dir))
    named = cfg.checkpoint.dir if checkpoint_dir is None else checkpoint_dir
    outside = named and (
        "://" in named or not Path(named).resolve().is_relative_to(run_dir.resolve())
    )
    if checkpoint_dir is None and outside:
        raise ConfigError(
            f"{run_dir / 'config.toml'} keeps checkpoints at {named[:200]!r}, outside the run "
            f"folder; pass --checkpoint-dir {named[:200]!r} to read them there"
        )
    checkpoint = dataclasses.replace(cfg.checkpoint, dir=named)
    return dataclasses.replace(cfg, run=run, checkpoint=checkpoint)


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
    """Saves (sync or async, at most one in flight) and commits checkpoints, applies retention
    after each commit, claims the location, and restores the newest good one (restore.py).

        A save that fails on any rank is failed on every rank: its directory is removed, the cause
        is logged as one line and passed to `on_failure`, and after `max_failed_saves` failures in a
        row `CheckpointError` stops the run (the newest committed checkpoint stays intact).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        run_id: str,
        layout: str,
        async_mode: bool,
        keep_temporary: int,
        logger: logging.Logger,
        resume_from: str = "",
        max_failed_saves: int = 3,
        collective_timeout_s: float = 7200.0,
        on_failure: Callable[[int, str], None] | None = None,
    ):
        self.storage, self.layout, self.async_mode = storage, layout, async_mode
        self.run_id, self.log = run_id, logger
        self.retention = Retention(
            storage, run_id=run_id, keep_temporary=keep_temporary, logger=logger
        )
        self.max_failed_saves, self.on_failure = max_failed_saves, on_failure
        self.comm = CheckpointGroup(collective_timeout_s)
        self.rank, self.world_size, self.group = (
            self.comm.rank,
            self.comm.world_size,
            self.comm.group,
        )
        self.restorer = Restorer(
            storage,
            self.comm,
            self.retention,
            run_id=run_id,
            resume_from=resume_from,
            logger=logger,
        )
        self.pending: _Pending | None = None
        # rank 0: step -> (path, kind, permanent)
        self.uncommitted: dict[int, tuple[str, str, bool, dict[str, Any]]] = {}
        self.failed_in_a_row = 0
        self.newest_committed: int | None = None

    # --- saving ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        permanent: bool,
        preempt: bool = False,
        notes: dict[str, Any] | None = None,
    ) -> None:
        """Collective. Returns once the state is captured (async) or written and committed
        (sync). Raises CheckpointError once `max_failed_saves` saves in a row have failed.
        `preempt`: the save a stop signal asked for (kind "preempt", see retention.py); with
        `permanent` too it is also kept like a permanent one. `notes`: facts about the state
        (JSON values) that the manifest records under "notes", for checks made before loading
        (`SavedLayoutAware`, the launcher)."""
        self.wait()
        kind = "preempt" if preempt else "permanent" if permanent else "temporary"
        path = self.storage.path(step_name(step))
        prepared: tuple[str | None, int | None] = (None, None)
        if self.rank == 0:
            try:
                self._check_owner()
                self.storage.remove(path)  # a torn save of this step from an earlier attempt
                self.storage.makedirs(path)
                prepared = (None, self.storage.free_bytes())
            except Exception as e:
                prepared = (str(e) if isinstance(e, StorageError) else one_line(e), None)
        prep_error, free_bytes = self.comm.broadcast(prepared)
        if prep_error is not None:
            # Nothing of this save was written: the folder, if any, is not this save's to remove
            # (another run's, when the location is not this run's).
            self._failed(step, None, f"checkpoint {step_name(step)} not saved: {prep_error}")
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
                self.uncommitted[step] = (path, kind, permanent, notes or {})
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
                self.uncommitted[step] = (path, kind, permanent, notes or {})
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
                    f"{path}/{rank_record(self.rank)}", json.dumps(writer.written)
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
            free_bytes=self.storage.free_bytes(),
        )

    def _settle(
        self, step: int, path: str, kind: str, attempt: Attempt, free_bytes: int | None
    ) -> None:
        """Collective: combine every rank's attempt; commit the save if all succeeded, else
        remove it and count the failure."""
        attempts = self.comm.all_gather(attempt)
        failed = [a for a in attempts if a.error is not None]
        commit_error = None
        if not failed:
            if self.rank == 0:
                try:
                    self._commit(step)
                except Exception as e:
                    commit_error = str(e) if isinstance(e, StorageError) else one_line(e)
            commit_error = self.comm.broadcast(commit_error)
        if not failed and commit_error is None:
            self.failed_in_a_row = 0
            self.newest_committed = step
            return
        needed = sum(a.planned_bytes for a in attempts)
        if any(a.disk_full for a in attempts) or (free_bytes is not None and needed > free_bytes):
            # Both moments: space taken by something else during the save leaves the disk
            # full at the failure although it had room as the save began.
            after = [a.free_bytes for a in failed if a.free_bytes is not None]
            began = "?" if free_bytes is None else mb_text(free_bytes)
            failed_at = mb_text(min(after)) if after else "?"
            cause = (
                f"disk full on {self.storage.url} ({failed_at} MB free when the save failed, "
                f"{began} MB as it began; {mb_text(needed)} MB needed)"
            )
        else:
            cause = failed[0].error if failed else f"commit failed ({commit_error})"
        self._failed(step, path, f"checkpoint {step_name(step)} not saved: {cause}")

    def _failed(self, step: int, path: str | None, message: str) -> None:
        """A failed save on every rank: remove its files (at `path`, if it wrote any), report
        it, stop after too many."""
        self.uncommitted.pop(step, None)
        if self.rank == 0 and path is not None:
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
        path, kind, permanent, notes = self.uncommitted[step]
        self._check_owner()
        files: dict[str, Any] = {}
        for r in range(self.world_size):
            files.update(json.loads(self.storage.read_text(f"{path}/{rank_record(r)}")))
        manifest = {
            "step": step,
            "run_id": self.run_id,
            "kind": kind,
            "permanent": permanent,
            "world_size": self.world_size,
            "layout": self.layout,
            "notes": notes,
            "distrain_version": version("distrain"),
            "torch_version": torch.__version__,
            "time": time.time(),
            "files": files,
        }
        write_manifest(self.storage, path, manifest)
        del self.uncommitted[step]
        self.newest_committed = step
        self.log.info("checkpoint %s committed", self.storage.url_of(path))
        self.retention.prune(self.newest_committed, in_flight=self.uncommitted)

    def commit_ready(self) -> None:
        """Rank 0, no collective: commit an async save whose ranks have all recorded their part,
        then apply retention. Cheap enough to call at every logging step; a storage error here
        is a warning (the collective `wait` settles the save for good)."""
        if self.rank != 0:
            return
        for step, (path, *_) in sorted(self.uncommitted.items()):
            try:
                names = set(self.storage.listdir(path))
                if all(rank_record(r) in names for r in range(self.world_size)):
                    self._commit(step)
            except Exception as e:
                self.log.warning("checkpoint step %d not committed yet: %s", step, one_line(e))

    def claim_location(self) -> None:
        """Collective, after resuming and before the first step (a start that fails before it
        leaves the location as it was): this run's checkpoints may go to its location only if
        no other run's do. The first run to start there records itself in OWNER.json; any
        other is refused in one line (two runs in one location delete each other's files)."""
        error = None
        if self.rank == 0:
            try:
                claim(self.storage, self.run_id)
            except CheckpointError as e:
                error = str(e)
            except Exception as e:
                error = f"cannot claim {self.storage.url}: {one_line(e)}"
        error = self.comm.broadcast(error)
        if error is not None:
            raise CheckpointError(error)

    def _check_owner(self) -> None:
        """Raise unless this run owns the checkpoint location (or nobody has claimed it)."""
        problem = owner_problem(self.storage, self.run_id)
        if problem is not None:
            raise CheckpointError(problem)

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
        """Collective. Load the newest checkpoint that verifies (restore.py); returns its step,
        or None."""
        restored = self.restorer.restore_latest(state)
        if restored is None:
            return None
        step, own = restored
        if own:
            self.newest_committed = step
        return step
