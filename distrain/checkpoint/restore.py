"""Resuming (`Restorer`): the newest checkpoint of this run whose manifest verifies, every rank
hashing a share of its files; a torn, truncated, corrupted or foreign one is reported and
skipped (and marked damaged for retention), and with none left checkpoint.resume_from names
another run's checkpoint to start from. A manifest and a `.metadata` are data from storage:
names must stay inside the checkpoint folder and the metadata is decoded without running code
(manifest.py, metadata.py); one that fails either check is skipped with its reason. A storage
that cannot be read stops the resume instead: falling back to an older checkpoint for that
would lose work for no reason."""

from __future__ import annotations

import logging
from typing import Any

from distrain.checkpoint.group import CheckpointGroup
from distrain.checkpoint.load import SavedLayoutAware, load
from distrain.checkpoint.manifest import (
    MANIFEST,
    UNREADABLE,
    Entry,
    manifest_problem,
    resume_from_step,
    scan,
    verify,
)
from distrain.checkpoint.ownership import owner_problem
from distrain.checkpoint.retention import Retention
from distrain.checkpoint.storage import Storage, StorageError, one_line
from distrain.errors import CheckpointError


class Restorer:
    def __init__(
        self,
        storage: Storage,
        comm: CheckpointGroup,
        retention: Retention,
        *,
        run_id: str,
        resume_from: str,
        logger: logging.Logger,
    ):
        self.storage, self.comm, self.retention = storage, comm, retention
        self.run_id, self.resume_from, self.log = run_id, resume_from, logger

    def restore_latest(self, state: dict[str, Any]) -> tuple[int, bool] | None:
        """Collective. Load the newest checkpoint that verifies into `state`; returns (its
        step, whether it is of this run's own location), or None. Rank 0 lists the candidates;
        every rank verifies a share of each one's files."""
        found: tuple[list[Entry], list[str], str | None] = ([], [], None)
        if self.comm.rank == 0:
            unlisted = (
                f"cannot list checkpoints under {self.storage.url}: %s; resuming is impossible "
                "until the storage answers"
            )
            try:
                problem = owner_problem(self.storage, self.run_id)
                if problem is not None:  # another run's location
                    raise CheckpointError(problem)
                found = (*scan(self.storage), None)
            except StorageError as e:
                found = ([], [], unlisted % e)
            except CheckpointError as e:
                found = ([], [], str(e))
            except Exception as e:
                found = ([], [], unlisted % one_line(e))
        entries, torn, error = self.comm.broadcast(found)
        if error is not None:
            raise CheckpointError(error)
        for name in torn:
            self.log.warning(
                "checkpoint %s is incomplete (no %s: its save never finished, or the manifest "
                "was deleted); ignoring it",
                self.storage.url_of(self.storage.path(name)),
                MANIFEST,
            )
        for entry in reversed(entries):
            if entry.manifest is not UNREADABLE and entry.manifest.get("run_id") != self.run_id:
                self.log.warning(
                    "checkpoint %s belongs to another run (run id %s); ignoring it (set "
                    "checkpoint.resume_from to start from it)",
                    self.storage.url_of(entry.path),
                    str(entry.manifest.get("run_id"))[:40],
                )
                continue
            if self._restored(self.storage, entry, state):
                return entry.step, True
            self.retention.damaged.add(entry.step)
        if self.resume_from:
            return self._restore_from(self.resume_from, state), False
        return None

    def _restored(self, storage: Storage, entry: Entry, state: dict[str, Any]) -> bool:
        """Collective: load `entry` into `state` if it verifies; else say why and return False."""
        problem = self._verify_shared(storage, entry)
        if problem is not None:
            self.log.warning(
                "checkpoint %s is damaged (%s); skipping it for the previous one",
                storage.url_of(entry.path),
                problem,
            )
            return False
        for part in state.values():
            if isinstance(part, SavedLayoutAware):
                part.saved_manifest(entry.manifest)
        load(storage, entry.path, state, process_group=self.comm.group)
        return True

    def _restore_from(self, location: str, state: dict[str, Any]) -> int:
        """Collective: start from another run's checkpoint folder (checkpoint.resume_from)."""
        parent, step = resume_from_step(location)
        storage = Storage(parent, retry_s=self.storage.retry_s)
        found: tuple[list[Entry], str | None] = ([], None)
        if self.comm.rank == 0:
            try:
                found = ([e for e in scan(storage)[0] if e.step == step], None)
            except Exception as e:
                found = ([], str(e) if isinstance(e, StorageError) else one_line(e))
        entries, error = self.comm.broadcast(found)
        if error is not None or not entries or not self._restored(storage, entries[0], state):
            raise CheckpointError(
                f"checkpoint.resume_from = {location!r} is not a complete, intact checkpoint"
                + (f" ({error})" if error else "")
            )
        self.log.warning(
            "starting from checkpoint %s of run %s (checkpoint.resume_from), step %d",
            storage.url_of(entries[0].path),
            str(entries[0].manifest.get("run_id"))[:40],
            step,
        )
        return step

    def _verify_shared(self, storage: Storage, entry: Entry) -> str | None:
        """Every rank checks every world_size-th file of `entry`; the first problem found (by
        rank) is everyone's verdict; a storage that cannot be read raises CheckpointError."""
        problem = manifest_problem(entry)
        if problem is not None:
            return problem
        share = sorted(entry.manifest["files"])[self.comm.rank :: self.comm.world_size]
        verdict: tuple[str | None, str | None] = (None, None)
        try:
            verdict = (verify(storage, entry, share), None)
        except StorageError as e:
            verdict = (None, str(e))
        except Exception as e:  # what the checkpoint holds, not the storage, is at fault
            verdict = (one_line(e), None)
        verdicts = self.comm.all_gather(verdict)
        fatal = [v[1] for v in verdicts if v[1] is not None]
        if fatal:
            raise CheckpointError(
                f"cannot verify checkpoint {storage.url_of(entry.path)}: {fatal[0]}"
            )
        return next((v[0] for v in verdicts if v[0] is not None), None)
