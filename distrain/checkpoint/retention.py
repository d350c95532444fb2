"""Which committed checkpoints a run keeps (`Retention`): the newest checkpoint.keep_temporary
temporary ones, the one just committed and every permanent one; torn saves older than the
newest committed checkpoint are removed. A preempt checkpoint is what the next start resumes
from: kept while it is the newest, counted as temporary once a later one is committed. Only
this run's checkpoints that can still be resumed count: a damaged one never pushes a good one
out, and another run's are never touched."""

from __future__ import annotations

import logging

from distrain.checkpoint.manifest import (
    Entry,
    committed,
    manifest_problem,
    remove_checkpoint,
    step_of,
)
from distrain.checkpoint.storage import Storage


class Retention:
    def __init__(
        self, storage: Storage, *, run_id: str, keep_temporary: int, logger: logging.Logger
    ):
        if keep_temporary < 1:
            raise ValueError("keep_temporary must be >= 1: the newest checkpoint is always kept")
        self.storage, self.run_id = storage, run_id
        self.keep_temporary, self.log = keep_temporary, logger
        self.damaged: set[int] = set()
        """Steps of this storage a resume found damaged: never counted."""

    def prune(self, newest_committed: int | None) -> None:
        """Rank 0, after a commit (no other save is in flight then): apply retention, sparing
        `newest_committed`. Never fatal: a storage error leaves the files for the next prune
        and logs a warning."""
        try:
            self._prune(newest_committed)
        except Exception as e:
            self.log.warning(
                "retention skipped on %s: %s", self.storage.url, str(e).splitlines()[0][:400]
            )

    def _prune(self, newest_committed: int | None) -> None:
        found = committed(self.storage)
        entries = [e for e in found if self._counts(e)]
        temporary = [
            e for e in entries if not e.permanent and not (e.kind == "preempt" and e is entries[-1])
        ]
        kept = {e.step for e in temporary[-self.keep_temporary :]} | {newest_committed}
        for entry in temporary:
            if entry.step not in kept:
                remove_checkpoint(self.storage, entry.path)
                self.log.info("retention: removed temporary checkpoint step %d", entry.step)
        newest_step = max((e.step for e in entries), default=-1)
        committed_steps = {e.step for e in found}
        for name in self.storage.listdir():
            step = step_of(name)
            if step is not None and step < newest_step and step not in committed_steps:
                self.storage.remove(self.storage.path(name))

    def _counts(self, entry: Entry) -> bool:
        """This run's, not found damaged, its manifest sound and every file it names there."""
        if entry.manifest.get("run_id") != self.run_id or entry.step in self.damaged:
            return False
        if manifest_problem(entry) is not None:
            return False
        present = set(self.storage.listdir(entry.path))
        return set(entry.manifest["files"]) <= present
