"""Decoding DCP's `.metadata` file, which is a pickle, without letting it run code.

A checkpoint folder may come from anyone who can write to the storage (a team bucket, a shared
run folder, a download), and the manifest's SHA-256 does not help: whoever rewrites `.metadata`
rewrites its hash too. So the pickle is decoded by a restricted virtual machine:

- every opcode is on an exact list; persistent ids, copyreg extension codes, protocol-0/1
  instantiation (INST, OBJ) and out-of-band buffers are refused;
- a global is looked up as an exact (module, qualified name) pair in `ALLOWED` - no prefixes,
  no dotted names resolved attribute by attribute, no imports;
- what a pickle may call (REDUCE, NEWOBJ) is one of the classes in `ALLOWED`, never a function:
  DCP's own dataclasses, `torch.Size`, `pathlib.PosixPath`, `collections.OrderedDict`, and
  `LayoutByName`, which stands in for torch's `_get_layout` and only looks a name up in a table;
  the other entries (dtypes) are values that cannot be called;
- BUILD sets only the declared fields of an instance of one of DCP's dataclasses, never
  attributes of a class (which would change it for the whole process).

Anything else is refused with one line naming the forbidden thing, before it is reached.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import pickletools
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from distrain.errors import CheckpointError
from distrain.files import plain_file_name

MAX_METADATA_BYTES = 1 << 30
"""A metadata file larger than this is refused unread: a 1,000-rank checkpoint of a 400B-parameter
model needs ~100 MB; a larger one is an attempt to exhaust memory."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint's metadata asks for something a checkpoint may not contain."""


class LayoutByName:
    """Stands in for `torch.serialization._get_layout` (how torch pickles a tensor layout):
    maps a layout's name to the layout, from an exact table, and does nothing else."""

    _table = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}

    def __new__(cls, name: object) -> Any:  # type: ignore[misc]
        if not isinstance(name, str) or name not in cls._table:
            raise UnsafeCheckpoint(f"unknown tensor layout {str(name)[:80]!r}")
        return cls._table[name]


# DCP's dataclasses whose instances a pickle may fill in with BUILD (their declared fields only).
_BUILDABLE: tuple[type, ...] = (
    dcp_metadata.Metadata,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.TensorProperties,
    dcp_metadata.StorageMeta,
    dcp_metadata.MetadataIndex,
    _StorageInfo,
)

ALLOWED: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _BUILDABLE},
    (dcp_metadata.__name__, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): LayoutByName,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}
"""Every global a checkpoint's metadata may name, as exact (module, qualified name) pairs."""

_CALLABLE = frozenset(v for v in ALLOWED.values() if isinstance(v, type))
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _BUILDABLE}

_REFUSED_OPCODES = {
    "PERSID": "a persistent id",
    "BINPERSID": "a persistent id",
    "EXT1": "a copyreg extension code",
    "EXT2": "a copyreg extension code",
    "EXT4": "a copyreg extension code",
    "INST": "protocol-0 instantiation (INST)",
    "OBJ": "protocol-1 instantiation (OBJ)",
    "NEXT_BUFFER": "an out-of-band buffer",
    "READONLY_BUFFER": "an out-of-band buffer",
}


def _refuse(what: str) -> Any:
    def refuse(self: _MetadataUnpickler) -> None:
        raise UnsafeCheckpoint(f"the pickle uses {what}, which a checkpoint may not contain")

    return refuse


def _unknown_opcode(self: _MetadataUnpickler) -> None:
    raise UnsafeCheckpoint("the pickle holds an unknown opcode")


def _shown(text: str, limit: int = 100) -> str:
    """At most `limit` characters of text the pickle chose, anything unprintable escaped: a refusal
    stays one line (a name holding a newline or a terminal escape would forge log lines)."""
    return text[:limit].encode("unicode_escape").decode("ascii")


def _name_of(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python VM: each opcode can be replaced
    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise UnsafeCheckpoint("the pickle names a global with a non-string name")
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpoint(
                f"refers to {_shown(module)}.{_shown(name)}, which a checkpoint may not contain"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(
            "the pickle uses a persistent id, which a checkpoint may not contain"
        )

    def _callable(self, target: Any, opcode: str) -> Any:
        if not (isinstance(target, type) and target in _CALLABLE):
            raise UnsafeCheckpoint(
                f"{opcode} calls {_name_of(target)}, which a checkpoint may not call"
            )
        return target

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self._callable(self.stack[-1], "REDUCE")
        if not isinstance(args, tuple):
            raise UnsafeCheckpoint("REDUCE with arguments that are not a tuple")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self._callable(self.stack.pop(), "NEWOBJ")
        if not isinstance(args, tuple):
            raise UnsafeCheckpoint("NEWOBJ with arguments that are not a tuple")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self._callable(self.stack.pop(), "NEWOBJ_EX")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise UnsafeCheckpoint("NEWOBJ_EX with malformed arguments")
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in _FIELDS:
            raise UnsafeCheckpoint(f"BUILD on {_name_of(inst)}, which a checkpoint may not set")
        if cls is dcp_metadata.TensorProperties:
            if not isinstance(state, tuple) or len(state) != 5:
                raise UnsafeCheckpoint("BUILD of TensorProperties with a malformed state")
            if not isinstance(state[3], enum.Enum):
                raise UnsafeCheckpoint("BUILD of TensorProperties with a malformed memory format")
            inst.__setstate__(state)
            return
        if not isinstance(state, dict) or not set(state) <= _FIELDS[cls]:
            raise UnsafeCheckpoint(f"BUILD sets undeclared fields of {cls.__qualname__}")
        inst.__dict__.update(state)

    dispatch = {code: _unknown_opcode for code in range(256)}
    for _op in pickletools.opcodes:
        _code = _op.code.encode("latin-1")[0]
        if _op.name in _REFUSED_OPCODES:
            dispatch[_code] = _refuse(_REFUSED_OPCODES[_op.name])
        else:
            dispatch[_code] = pickle._Unpickler.dispatch[_code]
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    del _op, _code


def decode_metadata(data: bytes) -> dcp_metadata.Metadata:
    """DCP's Metadata from the bytes of a `.metadata` file. Raises UnsafeCheckpoint naming what
    was refused, or CheckpointError when the bytes are not a readable DCP metadata pickle."""
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeCheckpoint(
            f"{len(data)} bytes, more than the {MAX_METADATA_BYTES} a metadata file may have"
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    # A damaged pickle fails in many ways (truncated, wrong types, bad arguments to an allowed
    # class); each is "unreadable", never code run.
    except Exception as e:
        first = _shown((str(e).splitlines() or [""])[0], 200)
        raise CheckpointError(
            f"not a readable metadata pickle ({type(e).__name__}: {first})"
        ) from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"holds a {type(metadata).__name__}, not DCP metadata")
    # NEWOBJ without BUILD leaves a Metadata with no entry index: readers would fail on it later.
    if not isinstance(vars(metadata).get("state_dict_metadata"), dict):
        raise CheckpointError("its entry index is missing or not a mapping")
    check_storage_paths(metadata)
    return metadata


def check_storage_paths(metadata: dcp_metadata.Metadata) -> None:
    """Every data file the metadata points at is a plain file name inside the checkpoint folder,
    so that a load cannot be sent to read `../../other-run` or `/dev/zero`."""
    storage_data = metadata.storage_data
    if storage_data is None:
        return
    if not isinstance(storage_data, dict):
        raise CheckpointError("its storage index is not a mapping")
    for info in storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise CheckpointError("its storage index holds an entry that is not a file location")
        if not plain_file_name(info.relative_path):
            raise UnsafeCheckpoint(
                f"points at {str(info.relative_path)[:100]!r}, outside the checkpoint folder"
            )
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise CheckpointError("its storage index holds a negative or non-integer offset")
