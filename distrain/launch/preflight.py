"""Cheap checks of the places a run reads and writes, made by `distrain train` before it starts
any worker: the data path exists (and a prepared token file's sidecar, or a local sharded
dataset's index, names data.tokenizer; so does each mixture source's; document masking has
boundaries to read), the eval sets' paths exist, the run directory and a local checkpoint
directory can take files (a probe file written and deleted), an object-store URL's filesystem is
installed, and so is each configured experiment tracker's library; replica groups' run secret
file is a private regular file of a usable length; a local checkpoint location holds a committed
checkpoint when --resume asks for one and belongs to no other run; a local
checkpoint.resume_from that the run would start from is a committed checkpoint folder. Which
checkpoint a start would resume (`resumed_checkpoint`) and whether it holds the configured model
(`check_resume_model`, family and tensor shapes as its manifest records them) are here too; the
CLI calls them with the configured model's record (cli._check_model), as models/ sits beside
launch/.

Cheap means no data is read (a corpus may be gigabytes) and nothing is left behind: a folder
that does not exist yet is not created, its nearest existing parent is probed instead. Reading the
data (token ids, text or binary) is the data package's job, when the workers open it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from fsspec.core import split_protocol
from fsspec.registry import get_filesystem_class, known_implementations

from distrain.checkpoint.checkpointer import checkpoint_storage
from distrain.checkpoint.manifest import MANIFEST, Entry, committed, resume_from_step, step_name
from distrain.checkpoint.ownership import owner_problem
from distrain.checkpoint.storage import Storage
from distrain.config.schema import CheckpointConfig, Config, RunConfig, source_names
from distrain.data.corpus import INDEX_NAME, is_sharded, is_token_data
from distrain.data.dataset import check_split
from distrain.data.documents import boundaries_file, no_boundaries_message
from distrain.data.shards import parse_index
from distrain.data.tokenizer import load_tokenizer
from distrain.data.tokfile import check_tokenizer, read_sidecar
from distrain.errors import ConfigError, MissingInput
from distrain.ft.network import read_secret
from distrain.launch.rundir import run_id
from distrain.observe.trackers import check_trackers_installed

_LOCAL_PROTOCOLS = (None, "file", "local")


def preflight(cfg: Config, *, absent: list[str] | None = None) -> None:
    """Raise ConfigError (one line naming the field, the path and the cause) for the first
    problem found. With `absent` (`train --check`), a data file, eval set, tokenizer or run
    secret that is not there is added to it (what was not checked) instead, and the rest is
    checked."""

    def noted(check: Callable[[], None]) -> None:
        try:
            check()
        except MissingInput as e:
            if absent is None:
                raise
            absent.append(str(e))

    if cfg.data.sources:
        for i, (source, name) in enumerate(
            zip(cfg.data.sources, source_names(cfg.data), strict=True)
        ):
            field = f"data.sources[{i}] ({name!r})"
            noted(partial(check_data_source, field, source.path, cfg.data.tokenizer))
    else:
        tokens = is_token_data(cfg.data)
        if cfg.data.path:
            noted(
                partial(
                    check_data_source, "data.path", cfg.data.path, cfg.data.tokenizer, tokens=tokens
                )
            )
    for e in cfg.data.eval_sets:
        noted(partial(check_eval_set, e.name, e.path))
    check_trackers_installed(cfg.metrics)
    if cfg.fault_tolerance.replica_groups and cfg.fault_tolerance.secret_file:
        noted(partial(read_secret, cfg.fault_tolerance.secret_file))
    if cfg.data.document_masking and cfg.data.eos_id is None:
        for path in [s.path for s in cfg.data.sources] or [cfg.data.path]:
            if absent is not None and _is_local(path) and not Path(path).exists():
                continue  # noted above: its boundaries cannot be looked for
            one = dataclasses.replace(cfg.data, path=path, sources=())
            if is_sharded(path) or boundaries_file(one) is None:
                raise ConfigError(no_boundaries_message(one))
    if not cfg.data.sources and _readable_here(cfg.data.path):
        check_split(cfg.data, cfg.training.seq_len, cfg.training.global_batch_size)
    check_writable("run.dir", Path(cfg.run.dir))
    protocol, _ = split_protocol(cfg.checkpoint.dir)
    if protocol in _LOCAL_PROTOCOLS:
        field = "checkpoint.dir" if cfg.checkpoint.dir else "run.dir (its checkpoints/ folder)"
        check_writable(field, Path(checkpoint_storage(cfg.checkpoint, cfg.run.dir).root))
        check_checkpoint_location(cfg.checkpoint, cfg.run)
    else:
        check_filesystem_installed("checkpoint.dir", cfg.checkpoint.dir, protocol)
    check_resume_from(cfg.checkpoint, cfg.run.dir)


def _readable_here(path: str) -> bool:
    """A corpus the launcher reads as the workers will: the default one, or a local file or
    folder that is not sharded (a sharded dataset's shards are fetched by the workers)."""
    if path == "":
        return True
    return _is_local(path) and Path(path).exists() and not is_sharded(path)


def check_checkpoint_location(checkpoint: CheckpointConfig, run: RunConfig) -> None:
    """A local checkpoint location: --resume (run.resume) finds a committed checkpoint in it,
    and no other run owns it (its OWNER.json names this run dir's run id, or nobody). The
    workers check again, and check an object store's location, which is not read here."""
    storage = checkpoint_storage(checkpoint, run.dir)
    if run.resume and not committed(storage):
        raise ConfigError(
            f"--resume: no complete checkpoint under {storage.url}; drop --resume to start a "
            "new run"
        )
    problem = owner_problem(storage, run_id(Path(run.dir), create=False))
    if problem is not None:
        raise ConfigError(problem)


def check_resume_from(checkpoint: CheckpointConfig, run_dir: str) -> None:
    """checkpoint.resume_from names a step folder; a local one that the run would start from
    (the run has no committed checkpoint of its own, in a local checkpoint folder) holds a
    manifest, the mark of a committed checkpoint. The workers still verify what they load."""
    location = checkpoint.resume_from
    if not location:
        return
    resume_from_step(location)
    own_protocol, _ = split_protocol(checkpoint.dir)
    protocol, path = split_protocol(location)
    if protocol not in _LOCAL_PROTOCOLS or own_protocol not in _LOCAL_PROTOCOLS:
        return
    if committed(checkpoint_storage(checkpoint, run_dir)):
        return  # the run resumes from its own checkpoints; resume_from is not read
    if not (Path(path) / MANIFEST).is_file():
        raise ConfigError(
            f"checkpoint.resume_from = {location!r}: no committed checkpoint there (no "
            f"{MANIFEST}); give a step folder that `distrain status` lists as committed"
        )


def resumed_checkpoint(checkpoint: CheckpointConfig, run_dir: str) -> tuple[Entry, str] | None:
    """The committed checkpoint a start would resume, as far as a local folder tells, and how
    to name it: the run's own newest (its run id's), else checkpoint.resume_from's. None when
    the run starts from scratch, or its checkpoints are not local (the workers check those)."""
    if not _is_local(checkpoint.dir):
        return None
    own = run_id(Path(run_dir), create=False)
    storage = checkpoint_storage(checkpoint, run_dir)
    entries = [e for e in committed(storage) if e.manifest.get("run_id") == own]
    if entries:
        return entries[-1], "this run dir's checkpoint"
    location = checkpoint.resume_from
    if not location or not _is_local(location):
        return None
    parent, step = resume_from_step(location)
    found = [e for e in committed(Storage(parent)) if e.step == step]
    return (found[0], "checkpoint.resume_from's checkpoint") if found else None


def check_resume_model(run_dir: str, entry: Entry, which: str, wanted: dict[str, Any]) -> None:
    """The checkpoint `entry` that the start would resume holds the configured model, `wanted`
    (models/registry.model_record): the same family and the same tensor shapes, as its manifest
    records them (a checkpoint saved before manifests recorded the model is left to the workers'
    load). A difference is refused in one line naming both models, before any worker starts.
    The CLI makes `wanted` (the model families sit beside launch/, not below it)."""
    saved = entry.manifest.get("model")
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        return
    difference = _model_difference(saved, wanted)
    if difference is None:
        return
    own_config = Path(run_dir) / "config.toml"
    way_out = (
        f"use another --run-dir, or the run's own config ({own_config})"
        if which.startswith("this run") and own_config.is_file()
        else "use another --run-dir, or a checkpoint of the configured model"
    )
    raise ConfigError(
        f"model: {which} {step_name(entry.step)} holds {_describe(saved)}, the config asks for "
        f"{_describe(wanted)}{difference}; {way_out}"
    )


def _describe(record: dict[str, Any]) -> str:
    family, preset = str(record.get("family"))[:40], str(record.get("preset"))[:40]
    return f"a {family} {preset!r} model ({str(record.get('summary'))[:200]})"


def _model_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """None when `saved` and `wanted` are one model (family and every tensor's shape); else ""
    where their summaries tell them apart, or the first tensor that does."""
    if saved.get("family") != wanted["family"]:
        return ""
    tensors = saved["tensors"]
    if tensors == wanted["tensors"]:
        return None
    if saved.get("summary") != wanted["summary"]:
        return ""
    for name in sorted(set(tensors) | set(wanted["tensors"])):
        have, want = tensors.get(name), wanted["tensors"].get(name)
        if have != want:
            return f" (tensor {str(name)[:100]}: {str(have)[:40]} saved, {want} configured)"
    return None


def check_eval_set(name: str, path: str) -> None:
    if not Path(path).exists():
        raise MissingInput(f"data.eval_sets {name!r}: no such file or folder {path!r}")


def _is_local(path: str) -> bool:
    return split_protocol(path)[0] in _LOCAL_PROTOCOLS


def check_data_source(field: str, path: str, tokenizer: str, *, tokens: bool = True) -> None:
    """The data at `path` exists and, where a small local file says so, was made with
    `tokenizer`; a URL's filesystem is installed (its index is read when workers open it)."""
    protocol, _ = split_protocol(path)
    if protocol not in _LOCAL_PROTOCOLS:
        check_filesystem_installed(field, path, protocol)
        return
    local = Path(path)
    if not local.exists():
        raise MissingInput(f"{field}: no such file or folder {path!r}")
    if (local / INDEX_NAME).is_file():
        index = parse_index((local / INDEX_NAME).read_bytes(), where=f"{field} {path}")
        if index.tokenizer_sha256 != load_tokenizer(tokenizer).fingerprint:
            raise ConfigError(
                f"{field} {path!r} was prepared with tokenizer {index.tokenizer!r} but "
                f"data.tokenizer is {tokenizer!r}; set data.tokenizer = {index.tokenizer!r}"
            )
    elif tokens and local.is_file():
        sidecar = read_sidecar(local)  # a small JSON file: cheap to read here
        if sidecar is not None:
            check_tokenizer(local, sidecar, load_tokenizer(tokenizer))


def check_writable(field: str, path: Path) -> None:
    """`path` is a folder, or can become one, where this process can create and delete files."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        problem = (
            "is a file, not a folder"
            if existing == path
            else f"cannot be created: {str(existing)!r} is a file"
        )
        raise ConfigError(f"{field} {str(path)!r} {problem}; choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".distrain-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{field} {str(path)!r} is not writable ({e.strerror} creating a file in "
            f"{str(existing)!r}); choose a writable folder"
        ) from None


def check_filesystem_installed(field: str, url: str, protocol: str) -> None:
    """fsspec can open `protocol://` URLs here: its implementation package is installed."""
    try:
        get_filesystem_class(protocol)
    except ImportError:
        package = known_implementations[protocol]["class"].split(".")[0]
        raise ConfigError(
            f"{field} {url!r} needs the {package} package for {protocol}:// URLs; "
            f"pip install {package}"
        ) from None
    except ValueError:
        raise ConfigError(
            f"{field} {url!r}: unknown protocol {protocol}://; use a local folder or an fsspec "
            "URL such as s3://bucket/run"
        ) from None
