"""Loading a checkpoint safely: DCP's metadata is decoded by metadata.py's restricted
unpickler and byte entries by `torch.load(weights_only=True)`, so a checkpoint can never run code;
a failed load is one line naming the checkpoint and the first rank's cause: a model that
disagrees with what the checkpoint's metadata declares (a tensor of another shape, or none) is a
mismatch, never called damage."""

from __future__ import annotations

import contextlib
import io
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from distrain.checkpoint.metadata import MAX_METADATA_BYTES, decode_metadata
from distrain.checkpoint.storage import CHUNK_BYTES, Storage
from distrain.errors import CheckpointError
from distrain.torch_compat import dcp_metadata_path, set_nested_element


def read_metadata(storage: Storage, meta_path: str) -> Metadata:
    """The DCP metadata at `meta_path` (a path of `storage`), decoded without running code."""

    def read() -> bytes:
        with storage.fs.open(meta_path, "rb") as stream:
            return _read_bounded(stream, storage.on_progress)

    data = storage.call(f"reading {storage.url_of(meta_path)}", read)
    return _decode(data, storage.url_of(meta_path))


def _read_bounded(stream: Any, on_chunk: Callable[[int], None]) -> bytes:
    """A metadata file's bytes, read a chunk at a time (each one progress), and at most one byte
    past MAX_METADATA_BYTES: enough for decode_metadata to refuse a larger one."""
    parts, total = [], 0
    while total <= MAX_METADATA_BYTES and (chunk := stream.read(CHUNK_BYTES)):
        parts.append(chunk)
        total += len(chunk)
        on_chunk(len(chunk))
    return b"".join(parts)


def _decode(data: bytes, where: str) -> Metadata:
    """checkpoint_metadata.decode_metadata, its refusal or damage one line naming the file."""
    try:
        return decode_metadata(data)
    except CheckpointError as e:
        raise type(e)(f"checkpoint metadata {where}: {e}") from None


def _safe_reader(storage: Storage, path: str) -> Any:
    """A DCP reader for `path` whose metadata is decoded by metadata.py."""
    base = storage.dcp_reader_class()

    class SafeReader(base):
        refused: CheckpointError | None = None
        """Why the metadata was refused: DCP folds it into a longer message of its own."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            meta_path = dcp_metadata_path(self, kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as stream:  # reports its own progress
                data = _read_bounded(stream, lambda _nbytes: None)
            try:
                metadata = _decode(data, storage.url_of(str(meta_path)))
            except CheckpointError as e:
                self.refused = e
                raise
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


_MODEL_MISMATCH = "Size mismatch between saved"
_MISSING_TENSOR = "Missing key in checkpoint state_dict"
"""How DCP's planner says that a tensor of the state to load has another shape in the
checkpoint's metadata, or none there."""


class SavedLayoutAware(Stateful):
    """A checkpoint part whose entries to load depend on the layout that saved them: given the
    checkpoint's manifest (its `layout`, ParallelDims.describe, and `notes`) before DCP asks it
    for the entries to load."""

    @abstractmethod
    def saved_manifest(self, manifest: dict[str, Any]) -> None: ...


NO_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""How DCP's save and load start the UserWarning they give when they run without a process
group: in a 1-process run (the Python API's too) that is what distrain means to do."""


@contextlib.contextmanager
def single_process(deliberate: bool) -> Iterator[None]:
    """Around one DCP save or load: its warning that it runs in a single process left out when
    `deliberate` (distrain runs it without a group on purpose), that message only; every other
    warning, and this one when not deliberate, as before."""
    if not deliberate:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_GROUP_WARNING, category=UserWarning)
        yield


def load(
    storage: Storage,
    path: str,
    state: dict[str, Any],
    *,
    partial: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the checkpoint at `path` into `state` in place (resharding to the current layout)."""
    reader = _safe_reader(storage, path)
    # One process: distrain starts no group for it (parallel/device.py).
    alone = process_group is None and not (dist.is_available() and dist.is_initialized())
    try:
        with single_process(alone):
            dcp.load(
                state,
                storage_reader=reader,
                planner=SafeLoadPlanner(allow_partial_load=partial),
                process_group=process_group,
            )
    # DCP wraps per-rank failures in CheckpointException (a BaseException); the cause is what the
    # user needs.
    except (Exception, CheckpointException) as e:
        if reader.refused is not None:
            raise CheckpointError(str(reader.refused)) from e
        cause = root_cause(e)
        if _MODEL_MISMATCH in cause or _MISSING_TENSOR in cause:
            # What the checkpoint's own metadata declares disagrees with the model to load: the
            # checkpoint holds another model, which is no damage.
            raise CheckpointError(
                f"checkpoint {storage.url_of(path)} holds another model than the configured one "
                f"(a mismatch, not damage: {cause}); train it with the config it was saved with "
                "(the run's config.toml), or use another --run-dir for this model"
            ) from e
        raise CheckpointError(
            f"checkpoint {storage.url_of(path)} is corrupt or unreadable ({root_cause(e)}); "
            "delete it or resume from an earlier one"
        ) from e


def root_cause(error: BaseException) -> str:
    """The first rank's underlying exception, as one short line."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
        if isinstance(error, AssertionError) and "; " in str(error):  # DCP's metadata read summary
            return " ".join(str(error).split())[:300]
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:300]}"
