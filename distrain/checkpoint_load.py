"""Loading a checkpoint safely: DCP's metadata goes through an allow-list unpickler and byte
entries through `torch.load(weights_only=True)`, so a checkpoint can never run code; a failed
load is one line naming the checkpoint and the first rank's cause."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from distrain.errors import CheckpointError
from distrain.storage import Storage
from distrain.torch_compat import dcp_metadata_path, set_nested_element


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


def load(
    storage: Storage,
    path: str,
    state: dict[str, Any],
    *,
    partial: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the checkpoint at `path` into `state` in place (resharding to the current layout)."""
    try:
        dcp.load(
            state,
            storage_reader=_safe_reader(storage, path),
            planner=SafeLoadPlanner(allow_partial_load=partial),
            process_group=process_group,
        )
    # DCP wraps per-rank failures in CheckpointException (a BaseException); the cause is what the
    # user needs.
    except (Exception, CheckpointException) as e:
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
