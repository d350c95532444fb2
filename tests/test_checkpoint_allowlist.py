"""The restricted unpickler's allow-list (checkpoint/metadata.py `ALLOWED`) is pinned, entry by
entry, and each class it lets a pickle call is built through the unpickler with hostile arguments
while an audit hook watches: none of them opens a file, touches the file system, the network or a
process, or imports anything.

"Every allowed value is a class or cannot be called" is not a safety property: adding
`("subprocess", "Popen")` to the table satisfies it and lets a checkpoint run a program. The
pinned set below fails on any addition or removal, so that such a change is reviewed.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import pickletools
import sys
import threading
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from distrain.checkpoint.metadata import (
    _CALLABLE,
    ALLOWED,
    LayoutByName,
    UnsafeCheckpoint,
    _MetadataUnpickler,
)

DCP = "torch.distributed.checkpoint.metadata"
# torch 2.13's dtypes (the only torch this project runs): a checkpoint names them as values.
DTYPES = """bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128
complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn
float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32
int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16
uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8""".split()
PINNED = {
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    (DCP, "BytesStorageMetadata"),
    (DCP, "ChunkStorageMetadata"),
    (DCP, "Metadata"),
    (DCP, "MetadataIndex"),
    (DCP, "StorageMeta"),
    (DCP, "TensorProperties"),
    (DCP, "TensorStorageMetadata"),
    (DCP, "_MEM_FORMAT_ENCODING"),
    *{("torch", name) for name in DTYPES},
}


def test_the_allow_list_is_exactly_the_reviewed_set():
    added, removed = set(ALLOWED) - PINNED, PINNED - set(ALLOWED)
    assert not added and not removed, (
        f"the checkpoint unpickler's allow-list changed (added {sorted(added)}, removed "
        f"{sorted(removed)}): a change to it needs a security review; then update PINNED"
    )
    # Each dtype entry is the dtype itself (a value, not something else under a dtype's name).
    assert all(ALLOWED[("torch", name)] is getattr(torch, name) for name in DTYPES)
    assert all(isinstance(ALLOWED[("torch", name)], torch.dtype) for name in DTYPES)


# --- every allowed class, built through the unpickler, touches nothing -------------------------

_SIDE_EFFECTS = ("open", "os.", "socket.", "subprocess.", "shutil.", "import", "exec", "compile")
_events: list[str] = []
_watching = threading.local()


def _audit(event: str, _args: tuple) -> None:
    if getattr(_watching, "on", False) and event.startswith(_SIDE_EFFECTS):
        _events.append(event)


sys.addaudithook(_audit)  # cannot be removed: it records only inside `_decode`


def _decode(data: bytes) -> tuple[Any, list[str]]:
    """The unpickler's result for `data` and the side-effect audit events during decoding."""
    _events.clear()
    _watching.on = True
    try:
        value = _MetadataUnpickler(io.BytesIO(data)).load()
    finally:
        _watching.on = False
    return value, list(_events)


class _Call:
    """Pickles as a call of `target(*args)` (REDUCE)."""

    def __init__(self, target: Any, args: tuple):
        self.target, self.args = target, args

    def __reduce__(self):
        return (self.target, self.args)


HOSTILE_CALLS = {
    "OrderedDict": (collections.OrderedDict, ([("/etc/passwd", "http://evil/")],)),
    "PosixPath": (pathlib.PosixPath, ("/etc/shadow",)),
    "Size": (torch.Size, ((2**62, 2**62),)),
    "LayoutByName": (LayoutByName, ("torch.strided",)),
    "_StorageInfo": (_StorageInfo, ("../../../etc/passwd", 0, 2**62)),
    "BytesStorageMetadata": (dcp_metadata.BytesStorageMetadata, ()),
    "ChunkStorageMetadata": (dcp_metadata.ChunkStorageMetadata, ((0,), (2**40,))),
    "Metadata": (dcp_metadata.Metadata, ({"/dev/zero": None},)),
    "MetadataIndex": (dcp_metadata.MetadataIndex, ("/proc/self/mem",)),
    "StorageMeta": (dcp_metadata.StorageMeta, ()),
    "TensorProperties": (dcp_metadata.TensorProperties, ()),
    "TensorStorageMetadata": (dcp_metadata.TensorStorageMetadata, (None, torch.Size([1]), [])),
    "_MEM_FORMAT_ENCODING": (dcp_metadata._MEM_FORMAT_ENCODING, (1,)),
}


def test_every_allowed_class_is_covered_here():
    assert {target for target, _ in HOSTILE_CALLS.values()} == set(_CALLABLE)


def _pickle(call: _Call, *, new: bool) -> bytes:
    """`call` as a pickle calling its target with REDUCE, or with NEWOBJ (`cls.__new__(cls,
    *args)`) when `new`."""
    data = pickletools.optimize(pickle.dumps(call, protocol=2))
    assert data.endswith(b"R.")
    if new:
        data = data[:-2] + pickle.NEWOBJ + pickle.STOP
    # LayoutByName stands in for torch.serialization._get_layout: name that, as torch does.
    return data.replace(
        f"{LayoutByName.__module__}\n{LayoutByName.__qualname__}\n".encode(),
        b"torch.serialization\n_get_layout\n",
    )


@pytest.mark.parametrize("name", sorted(HOSTILE_CALLS))
@pytest.mark.parametrize("new", [False, True], ids=["REDUCE", "NEWOBJ"])
def test_building_an_allowed_class_touches_no_file_network_or_process(name, new):
    target, args = HOSTILE_CALLS[name]
    try:
        value, events = _decode(_pickle(_Call(target, args), new=new))
    except (TypeError, ValueError, UnsafeCheckpoint) as error:
        # Refusing the arguments is also safe; the point is what ran before.
        value, events = error, list(_events)
    assert events == [], (name, events)
    if not isinstance(value, Exception):
        assert type(value) is not type or value in ALLOWED.values()
        assert type(value).__module__.split(".")[0] in ("collections", "pathlib", "torch")


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("subprocess", "Popen"),
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("posix", "system"),
        ("pathlib", "Path.open"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
        ("torch", "load"),
        ("torch.serialization", "load"),
    ],
)
def test_a_pickle_naming_anything_else_is_refused_before_it_is_reached(module, name):
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x01\x00\x00\x00a\x85R."
    with pytest.raises(UnsafeCheckpoint, match=f"refers to {module}.{name}"):
        _decode(data)
    assert _events == []


def test_the_watch_sees_what_a_dangerous_entry_would_do(monkeypatch, tmp_path):
    """The audit above is not blind: with `subprocess.Popen` added to the table (the mutation
    of the review), decoding runs a program, and the watch records it."""
    import subprocess

    import distrain.checkpoint.metadata as metadata

    monkeypatch.setitem(metadata.ALLOWED, ("subprocess", "Popen"), subprocess.Popen)
    monkeypatch.setattr(metadata, "_CALLABLE", metadata._CALLABLE | {subprocess.Popen})
    marker = tmp_path / "ran"
    args = pickletools.optimize(pickle.dumps((["touch", str(marker)],), protocol=2))[2:-1]
    process, events = _decode(b"\x80\x02csubprocess\nPopen\n" + args + b"R.")
    process.wait()
    assert "subprocess.Popen" in events and marker.exists()
