"""Checkpoints: sharded DCP saves in <checkpoint dir>/step-<NNNNNNNN>/, committed by a manifest
(the layout and the manifest: manifest.py).

Protocol (the same for a local folder and an object store):
1. every rank writes its DCP shards, hashing each file's bytes as they go out
   (storage.HashingWriter: nothing is read back): from the training thread (checkpoint.async_mode
   "off"), or from a writer thread that writes a staged copy (staging.py) while training goes on
   ("thread"; every later step of the protocol runs in that thread too), or from that thread
   with the files' bytes written by a process of this rank's own ("process", writer_process.py);
2. when its part is written, each rank records the size and SHA-256 of the files it wrote in a
   small `rank<N>.json` beside them;
3. rank 0, once every rank's record is there, writes MANIFEST.json (files, sizes, checksums,
   step, kind, world size, layout, the state's notes, the model it holds (family, preset,
   arguments, tensor shapes; absent from older checkpoints), versions) last and atomically. Only
   then does the checkpoint exist for resume, and only then does retention delete older
   temporary checkpoints.
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

import dataclasses
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distrain.checkpoint.group import CheckpointGroup
from distrain.checkpoint.load import root_cause, single_process
from distrain.checkpoint.manifest import rank_record, step_name, write_manifest
from distrain.checkpoint.ownership import claim, owner_problem
from distrain.checkpoint.restore import Restorer
from distrain.checkpoint.retention import Retention
from distrain.checkpoint.save_attempt import Attempt, disk_full, mb_text
from distrain.checkpoint.staging import Stager
from distrain.checkpoint.storage import HashingWriter, Storage, StorageError, one_line
from distrain.checkpoint.writer_process import OffloadedWriter, WriterProcess
from distrain.config.schema import CheckpointConfig
from distrain.errors import CheckpointError, ConfigError
from distrain.observe import heartbeat
from distrain.version import version


def checkpoint_storage(checkpoint: CheckpointConfig, run_dir: str) -> Storage:
    """Where the checkpoints of the run in `run_dir` live: checkpoint.dir, or
    <run_dir>/checkpoints by default. The bytes it moves are progress for the hang watchdog."""
    return Storage(
        checkpoint.dir or str(Path(run_dir) / "checkpoints"),
        retry_s=checkpoint.storage_retry_s,
        on_progress=heartbeat.moved,
    )


def read_checkpoints_of(
    checkpoint: CheckpointConfig, run_dir: Path, checkpoint_dir: str | None
) -> Storage:
    """Where a reading command (generate, export) takes the checkpoints of the run in `run_dir`
    from (`checkpoint`: the checkpoint section of its config.toml): `checkpoint_dir` when given,
    else the run's own location, which must lie inside the run folder. A run folder is data that
    anyone may have written: a checkpoint.dir elsewhere (another folder, a bucket) is read only
    when the user names it."""
    named = checkpoint.dir if checkpoint_dir is None else checkpoint_dir
    outside = named and (
        "://" in named or not Path(named).resolve().is_relative_to(run_dir.resolve())
    )
    if checkpoint_dir is None and outside:
        raise ConfigError(
            f"{run_dir / 'config.toml'} keeps checkpoints at {named[:200]!r}, outside the run "
            f"folder; pass --checkpoint-dir {named[:200]!r} to read them there"
        )
    # The run may have moved since it was trained: its folder is `run_dir`, not its run.dir.
    return checkpoint_storage(dataclasses.replace(checkpoint, dir=named), str(run_dir))


ASYNC_MODES = ("off", "thread", "process")


@dataclass(frozen=True)
class SaveRecord:
    """A settled save, as metrics report it: `stall_s`, what the training step waited for it
    (the previous save still in flight and the staging copy; the whole save when synchronous);
    `write_s`, from the start of its writing to its commit or failure; `bytes`, what every rank
    set out to write; `error`, the one-line cause of a failed save."""

    step: int
    kind: str
    stall_s: float
    write_s: float
    bytes: int
    error: str | None = None


@dataclass
class _Save:
    """One save from its request to its verdict."""

    step: int
    kind: str
    permanent: bool
    notes: dict[str, Any]
    asked_at: float
    stall_s: float = 0.0


class Checkpointer:
    """Saves and commits checkpoints, applies retention after each commit, claims the location,
    and restores the newest good one (restore.py).

    `async_mode` "off": a save is written, verified and committed before `save` returns.
    "thread": `save` returns once the state is staged (staging.py); a writer thread writes,
    verifies and commits it while training goes on. "process": the same, with the files
    serialized, hashed and written by a writer process (writer_process.py). At most one save
    is in flight: the next one, the end of the run and a stop signal's save wait for it first
    (a save skipped instead could leave a run that saves more often than it can write with no
    checkpoint at all).

    A save that fails on any rank is failed on every rank: its directory is removed, the cause
    is logged as one line and passed to `on_failure`, and training goes on; after
    `max_failed_saves` failures in a row `CheckpointError` stops the run (the newest committed
    checkpoint stays intact). `on_saved` hears of every settled save (SaveRecord). Both are
    called on the training thread, from `save`, `wait` and `report_settled`.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        run_id: str,
        layout: str,
        async_mode: str,
        keep_temporary: int,
        logger: logging.Logger,
        resume_from: str = "",
        max_failed_saves: int = 3,
        collective_timeout_s: float = 7200.0,
        pinned_staging: bool = False,
        on_failure: Callable[[int, str], None] | None = None,
        on_saved: Callable[[SaveRecord], None] | None = None,
        before_commit: Callable[[int, str], None] | None = None,
        model: dict[str, Any] | None = None,
    ):
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, not {async_mode!r}")
        self.storage, self.layout, self.async_mode = storage, layout, async_mode
        self.run_id, self.log = run_id, logger
        self.model = model
        """The manifest's "model" (models/registry.model_record): what the launcher compares
        with the configured model before resuming; None records nothing."""
        self.retention = Retention(
            storage, run_id=run_id, keep_temporary=keep_temporary, logger=logger
        )
        self.max_failed_saves = max_failed_saves
        self.on_failure, self.on_saved, self.before_commit = on_failure, on_saved, before_commit
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
        self.stager = (
            None
            if async_mode == "off"
            else Stager(pinned=pinned_staging, shared=async_mode == "process")
        )
        self.writer_process: WriterProcess | None = None
        self.in_flight: Future | None = None
        self._settled: list[SaveRecord] = []
        self._settled_lock = threading.Lock()
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
        """Collective. Returns once the state is staged (async) or written and committed
        (off). Raises CheckpointError once `max_failed_saves` saves in a row have failed.
        `preempt`: the save a stop signal asked for (kind "preempt", see retention.py); with
        `permanent` too it is also kept like a permanent one. `notes`: facts about the state
        (JSON values) that the manifest records under "notes", for checks made before loading
        (`SavedLayoutAware`, the launcher)."""
        asked_at = time.perf_counter()
        self.wait()
        kind = "preempt" if preempt else "permanent" if permanent else "temporary"
        job = _Save(step, kind, permanent, notes or {}, asked_at)
        if self.stager is None:
            try:
                self._write(job, state)
            finally:
                self.report_settled()
            return
        staged = self.stager.stage(state)
        job.stall_s = time.perf_counter() - asked_at
        self.log.info("checkpoint step %d (%s) staged in %.2fs", step, kind, job.stall_s)
        self.in_flight = _in_thread(lambda: self._write(job, staged), f"checkpoint-{step}")

    def wait(self) -> None:
        """Finish the save in flight, if any, and report every settled save. Raises what the
        save raised: CheckpointError after `max_failed_saves` failures in a row (or a broken
        collective)."""
        future, self.in_flight = self.in_flight, None
        try:
            if future is not None:
                future.result()
        finally:
            self.report_settled()

    def report_settled(self) -> None:
        """Hand every save settled since the last call to `on_saved` / `on_failure`, on the
        calling (training) thread. No collective; cheap enough for every logging step."""
        with self._settled_lock:
            settled, self._settled = self._settled, []
        for record in settled:
            if record.error is not None and self.on_failure is not None:
                self.on_failure(record.step, record.error)
            if self.on_saved is not None:
                self.on_saved(record)

    def close(self, timeout_s: float) -> None:
        """At the end of the process: give a save still in flight (after an error: a finished
        run has waited for it) up to `timeout_s` to settle, as the other ranks' writers finish
        the protocol with this one while they live; then stop the writer process and free the
        staging buffers. Never raises: the error that ended the run is the one to report."""
        future, self.in_flight = self.in_flight, None
        if future is not None:
            try:
                future.result(timeout=timeout_s)
            except TimeoutError:
                self.log.warning(
                    "the checkpoint save in flight did not settle within %.0fs; leaving it "
                    "uncommitted",
                    timeout_s,
                )
            except BaseException as e:
                self.log.warning("the checkpoint save in flight failed: %s", one_line(e))
        if self.writer_process is not None:
            self.writer_process.close()
            self.writer_process = None
        if self.stager is not None:
            self.stager.close()

    def _write(self, job: _Save, state: dict[str, Any]) -> None:
        """Collective over the checkpoint group (in the writer thread for a background save):
        prepare the folder, write this rank's part, settle the save on every rank."""
        started = time.perf_counter()
        path = self.storage.path(step_name(job.step))
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
            message = f"checkpoint {step_name(job.step)} not saved: {prep_error}"
            self._failed(job, None, message, started, planned_bytes=0)
            return
        writer = self.storage.dcp_writer(path)
        error: BaseException | None = None
        try:
            target = writer if self.async_mode != "process" else self._offloaded(writer, path)
            # One process: no collective at all (the default group may be NCCL's, which a
            # writer thread must not share with training).
            with single_process(self.group is None):
                dcp.save(
                    state,
                    storage_writer=target,
                    process_group=self.group,
                    no_dist=self.group is None,
                )
        except (Exception, CheckpointException) as e:
            error = e
        attempt = self._finish_part(path, writer, error)
        if attempt.error is None:
            self.log.info(
                "checkpoint step %d (%s) written in %.2fs",
                job.step,
                job.kind,
                time.perf_counter() - started,
            )
        if self.before_commit is not None:
            self.before_commit(job.step, job.kind)
        self._settle(job, path, attempt, free_bytes, started)

    def _offloaded(self, writer: HashingWriter, path: str) -> OffloadedWriter:
        """`writer` with its files written by the writer process (a new one if it died)."""
        if self.writer_process is not None and not self.writer_process.alive():
            self.writer_process.close()
            self.writer_process = None
        if self.writer_process is None:
            self.writer_process = WriterProcess()
        return OffloadedWriter(writer, self.writer_process, self.storage, path)

    def _finish_part(
        self, path: str, writer: HashingWriter, error: BaseException | None
    ) -> Attempt:
        """This rank's verdict on its part; on success its file record (size and SHA-256 of
        each file, hashed while writing) goes beside the files."""
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
        self, job: _Save, path: str, attempt: Attempt, free_bytes: int | None, started: float
    ) -> None:
        """Collective: combine every rank's attempt; commit the save if all succeeded, else
        remove it and count the failure."""
        attempts = self.comm.all_gather(attempt)
        failed = [a for a in attempts if a.error is not None]
        needed = sum(a.planned_bytes for a in attempts)
        commit_error = None
        if not failed:
            if self.rank == 0:
                try:
                    self._commit(job, path)
                except Exception as e:
                    commit_error = str(e) if isinstance(e, StorageError) else one_line(e)
            commit_error = self.comm.broadcast(commit_error)
        if not failed and commit_error is None:
            self.failed_in_a_row = 0
            self.newest_committed = job.step
            self._record(job, started, needed)
            return
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
        message = f"checkpoint {step_name(job.step)} not saved: {cause}"
        self._failed(job, path, message, started, planned_bytes=needed)

    def _record(
        self, job: _Save, started: float, planned_bytes: int, error: str | None = None
    ) -> None:
        """Note the verdict for `report_settled` (a synchronous save stalled for all of it)."""
        now = time.perf_counter()
        stall_s = job.stall_s if self.stager is not None else now - job.asked_at
        record = SaveRecord(job.step, job.kind, stall_s, now - started, planned_bytes, error)
        with self._settled_lock:
            self._settled.append(record)

    def _failed(
        self, job: _Save, path: str | None, message: str, started: float, *, planned_bytes: int
    ) -> None:
        """A failed save on every rank: remove its files (at `path`, if it wrote any), report
        it, stop after too many."""
        if self.rank == 0 and path is not None:
            try:
                self.storage.remove(path)
            except Exception as e:
                self.log.warning("could not remove the failed save %s: %s", path, one_line(e))
        self.failed_in_a_row += 1
        self.log.error("%s", message)
        self._record(job, started, planned_bytes, message)
        if self.failed_in_a_row >= self.max_failed_saves:
            newest = "none" if self.newest_committed is None else step_name(self.newest_committed)
            raise CheckpointError(
                f"{message}; {self.failed_in_a_row} saves in a row failed "
                f"(checkpoint.max_failed_saves = {self.max_failed_saves}), stopping; newest "
                f"committed checkpoint: {newest}"
            )

    def _commit(self, job: _Save, path: str) -> None:
        """Rank 0: write the manifest of a save whose ranks have all recorded their part."""
        self._check_owner()
        files: dict[str, Any] = {}
        for r in range(self.world_size):
            files.update(json.loads(self.storage.read_text(f"{path}/{rank_record(r)}")))
        manifest = {
            "step": job.step,
            "run_id": self.run_id,
            "kind": job.kind,
            "permanent": job.permanent,
            "world_size": self.world_size,
            "layout": self.layout,
            "notes": job.notes,
            "model": self.model,
            "distrain_version": version(),
            "torch_version": torch.__version__,
            "time": time.time(),
            "files": files,
        }
        write_manifest(self.storage, path, manifest)
        self.newest_committed = job.step
        self.log.info("checkpoint %s committed", self.storage.url_of(path))
        self.retention.prune(self.newest_committed)

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


def _in_thread(fn: Callable[[], None], name: str) -> Future:
    """`fn()` in a daemon thread: a save stuck in a collective never keeps a crashed process
    from exiting. The future holds what it raised."""
    future: Future = Future()

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
