"""What a checkpoint location holds, read and written as data: step folders
(`step-<NNNNNNNN>/`), each committed by its MANIFEST.json (files, sizes, SHA-256, step, kind,
run id), which is written last and removed first. `scan` lists the entries with their manifests
(validated, names confined to the folder), `verify` checks files against a manifest, `rewind`
makes an older step the newest. The save/commit/resume protocol over this layout is
checkpointer.py's.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from distrain.checkpoint.load import read_metadata
from distrain.checkpoint.storage import Storage, StorageError
from distrain.errors import CheckpointError
from distrain.files import plain_file_name

MANIFEST = "MANIFEST.json"
UNREADABLE: dict[str, Any] = {"unreadable": True}
"""The manifest of an Entry whose MANIFEST.json is not a readable JSON object."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
STEP_PREFIX = "step-"
OWNER = "OWNER.json"
"""At the root of a checkpoint location: the run that writes there."""
DCP_METADATA = ".metadata"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    suffix = name.removeprefix(STEP_PREFIX)
    return int(suffix) if name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def resume_from_step(location: str) -> tuple[str, int]:
    """checkpoint.resume_from's parent folder and step, from its step folder's name."""
    parent, name = posixpath.split(location.rstrip("/"))
    step = step_of(name)
    if step is None:
        raise CheckpointError(
            f"checkpoint.resume_from = {location!r}: expected a checkpoint folder named "
            f"{STEP_PREFIX}NNNNNNNN (<run>/checkpoints/{STEP_PREFIX}NNNNNNNN)"
        )
    return parent, step


def rank_record(rank: int) -> str:
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
        step = step_of(name)
        if step is None:
            continue
        path = storage.path(name)
        if not storage.exists(f"{path}/{MANIFEST}"):
            torn.append(name)
            continue
        try:
            manifest = json.loads(storage.read_text(f"{path}/{MANIFEST}"))
        except (OSError, ValueError):  # not StorageError: an unreachable store is no verdict
            manifest = None
        found.append(Entry(step, path, manifest if isinstance(manifest, dict) else UNREADABLE))
    return sorted(found, key=lambda e: e.step), torn


def committed(storage: Storage) -> list[Entry]:
    """Every checkpoint with a manifest, oldest first (not yet verified)."""
    return scan(storage)[0]


def manifest_problem(entry: Entry) -> str | None:
    """Why `entry`'s manifest cannot be trusted to describe its folder, or None. A manifest is
    data from storage: its names must stay inside the folder and its entries be well formed."""
    manifest = entry.manifest
    if manifest is UNREADABLE:
        return "manifest unreadable"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for name, info in files.items():
        if not plain_file_name(name):
            return f"manifest names {str(name)[:80]!r}, which is not a file in the checkpoint"
        if not (
            isinstance(info, dict)
            and type(info.get("size")) is int
            and info["size"] >= 0
            and isinstance(info.get("sha256"), str)
            and _SHA256.fullmatch(info["sha256"])
        ):
            return f"manifest entry {name!r} is malformed (needs a size and a SHA-256)"
    if DCP_METADATA not in files:
        return f"manifest lists no {DCP_METADATA}"
    if manifest.get("step") != entry.step:
        return f"manifest says step {str(manifest.get('step'))[:20]}, its folder {entry.step}"
    return None


def verify(storage: Storage, entry: Entry, names: list[str] | None = None) -> str | None:
    """None if the files `names` (default: all the manifest lists) are there with their size and
    checksum, else why not. The `.metadata` among them is also decoded (it may not ask for
    anything a checkpoint may not contain) and must point only at files the manifest lists,
    within their sizes. Raises StorageError only when the storage cannot be read."""
    problem = manifest_problem(entry)
    if problem is not None:
        return problem
    files = entry.manifest["files"]
    for name in sorted(files) if names is None else names:
        size = files[name]["size"]
        path = f"{entry.path}/{name}"
        if not storage.exists(path):
            return f"{name} is missing"
        if storage.size(path) != size:
            return f"{name} has {storage.size(path)} bytes, manifest says {size}"
        if storage.sha256(path, max_bytes=size) != files[name]["sha256"]:
            return f"{name} fails its SHA-256 checksum"
        if name == DCP_METADATA:
            try:
                problem = _metadata_problem(read_metadata(storage, path), files)
            except StorageError:
                raise
            except CheckpointError as e:
                return str(e)
            if problem is not None:
                return f"{name}: {problem}"
    return None


def _metadata_problem(metadata: Any, files: dict[str, Any]) -> str | None:
    """Whether the decoded metadata reads only files of the manifest, within their sizes."""
    for info in (metadata.storage_data or {}).values():
        listed = files.get(info.relative_path)
        if listed is None:
            return f"points at {info.relative_path!r}, which the manifest does not list"
        if info.offset + info.length > listed["size"]:
            return f"reads past the end of {info.relative_path}"
    return None


def rewind(storage: Storage, step: int) -> list[str]:
    """Make `step` the newest committed checkpoint of `storage` (`distrain train --resume-from
    STEP`, before the workers start): delete the newer ones, refusing when one is permanent.
    Returns the names deleted."""
    entries = committed(storage)
    if not any(e.step == step for e in entries):
        steps = ", ".join(str(e.step) for e in entries) or "none"
        raise CheckpointError(
            f"--resume-from {step}: no complete checkpoint of step {step} under {storage.url} "
            f"(steps there: {steps})"
        )
    newer = [e for e in entries if e.step > step]
    permanent = [step_name(e.step) for e in newer if e.permanent]
    if permanent:
        raise CheckpointError(
            f"--resume-from {step}: the newer checkpoint(s) {', '.join(permanent)} are permanent "
            "and would be deleted; move them out of the run, or start a new run dir with "
            f"--resume-from {storage.url_of(storage.path(step_name(step)))}"
        )
    for entry in reversed(newer):
        remove_checkpoint(storage, entry.path)
    return [step_name(e.step) for e in newer]


def remove_checkpoint(storage: Storage, path: str) -> None:
    """Manifest first: a removal cut short leaves a torn save (ignored and later pruned), never
    a committed checkpoint with files missing."""
    storage.remove(f"{path}/{MANIFEST}")
    storage.remove(path)


def write_manifest(storage: Storage, path: str, manifest: dict[str, Any]) -> None:
    """The commit point: nothing refers to a checkpoint before its manifest exists."""
    storage.write_text_atomic(f"{path}/{MANIFEST}", json.dumps(manifest, indent=1))
