"""Which run a checkpoint location belongs to: its OWNER.json, written by the first run that
starts there and read by every later start, and by `distrain train` before launch. Two runs in
one location would delete each other's checkpoints (retention), so any other run is refused in
one line; starting from another run's checkpoint is checkpoint.resume_from's job."""

from __future__ import annotations

import json
import time
from typing import Any

from distrain.checkpoint.manifest import OWNER
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError


def location_owner(storage: Storage) -> dict[str, Any] | None:
    """The run that claimed the checkpoint location `storage` (its OWNER.json), or None."""
    path = storage.path(OWNER)
    if not storage.exists(path):
        return None
    try:
        owner = json.loads(storage.read_text(path))
    except ValueError:
        owner = None
    if not isinstance(owner, dict) or not isinstance(owner.get("run_id"), str):
        raise CheckpointError(
            f"checkpoint location {storage.url} has an unreadable {OWNER}; "
            "choose another checkpoint.dir"
        )
    return owner


def owner_problem(storage: Storage, run_id: str | None) -> str | None:
    """Why the run `run_id` (None: a run not started yet) may not write to `storage`, another
    run's checkpoint location; None when it may."""
    owner = location_owner(storage)
    if owner is None or owner["run_id"] == run_id:
        return None
    return (
        f"checkpoint.dir {storage.url} belongs to another run (run id "
        f"{owner['run_id'][:40]}, since {str(owner.get('since'))[:40]}); give this run "
        "its own checkpoint.dir, or set checkpoint.resume_from to start from one of "
        "that run's checkpoints"
    )


def claim(storage: Storage, run_id: str) -> None:
    """Record `run_id` as the owner of `storage` if nobody is, then raise (CheckpointError, one
    line) unless it is the owner."""
    if location_owner(storage) is None:
        owner = {"run_id": run_id, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        storage.write_text_atomic(storage.path(OWNER), json.dumps(owner))
    problem = owner_problem(storage, run_id)
    if problem is not None:
        raise CheckpointError(problem)
