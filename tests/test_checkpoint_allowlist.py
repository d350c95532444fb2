"""The restricted unpickler's allow-list (checkpoint/metadata.py `ALLOWED`) is pinned, entry by
entry and value by value, and each class it lets a pickle call is built through the unpickler
with hostile arguments - named by GLOBAL and by STACK_GLOBAL, called by REDUCE, NEWOBJ and
NEWOBJ_EX - while an audit hook records every event Python raises: none fires (no file opened,
no file system, network, process, import or code event), and what comes back is inert data.

"Every allowed value is a class or cannot be called" is not a safety property: adding
`("subprocess", "Popen")` to the table satisfies it and lets a checkpoint run a program. The
pinned table below fails on any addition, removal or swapped value, so that such a change is
reviewed; the last test shows the audit hook does see what such an entry would do.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import io
import pathlib
import pickle
import re
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

import distrain.checkpoint.metadata as metadata
from distrain.checkpoint.metadata import (
    _CALLABLE,
    ALLOWED,
    LayoutByName,
    UnsafeCheckpoint,
    _MetadataUnpickler,
    decode_metadata,
)
from distrain.errors import CheckpointError

DCP = "torch.distributed.checkpoint.metadata"
FS = "torch.distributed.checkpoint.filesystem"
# torch 2.13's dtypes (the only torch this project runs): a checkpoint names them as values.
DTYPES = """bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128
complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn
float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32
int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16
uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8""".split()
# Everything a pickle may call, under the exact name it may use for it.
CLASSES: dict[tuple[str, str], type] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): LayoutByName,  # not torch's function: a table lookup
    (FS, "_StorageInfo"): _StorageInfo,
    (DCP, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (DCP, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (DCP, "Metadata"): dcp_metadata.Metadata,
    (DCP, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (DCP, "StorageMeta"): dcp_metadata.StorageMeta,
    (DCP, "TensorProperties"): dcp_metadata.TensorProperties,
    (DCP, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (DCP, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
}
PINNED: dict[tuple[str, str], Any] = {
    **CLASSES,
    **{("torch", name): getattr(torch, name) for name in DTYPES},
}
REVIEW = (
    "a change to the checkpoint unpickler's allow-list needs a security review, then PINNED updated"
)


def test_the_allow_list_is_exactly_the_reviewed_set():
    added, removed = set(ALLOWED) - set(PINNED), set(PINNED) - set(ALLOWED)
    assert not added and not removed, (
        f"the allow-list changed (added {sorted(added)}, removed {sorted(removed)}): {REVIEW}"
    )
    swapped = sorted(key for key in PINNED if ALLOWED[key] is not PINNED[key])
    assert not swapped, f"the allow-list maps {swapped} to something else: {REVIEW}"
    assert all(isinstance(ALLOWED[("torch", name)], torch.dtype) for name in DTYPES)
    # What a pickle may call is exactly the pinned classes; every other entry is a dtype value.
    assert set(_CALLABLE) == set(CLASSES.values()), REVIEW


# --- the watch: every audit event raised while the unpickler runs --------------------------------

_events: list[str] = []
_watching = threading.local()


def _audit(event: str, _args: tuple) -> None:
    if getattr(_watching, "on", False):
        _events.append(event)


sys.addaudithook(_audit)  # cannot be removed: it records only inside `_watched`


def _watched(data: bytes) -> tuple[Any, list[str]]:
    """The unpickler's result for `data` (or the exception it raised) and every audit event
    raised while it ran. The collector is off meanwhile: an earlier test's finalizer must not
    run inside the watch."""
    _events.clear()
    collecting = gc.isenabled()
    gc.disable()
    _watching.on = True
    try:
        value: Any = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:
        value = error
    finally:
        _watching.on = False
        if collecting:
            gc.enable()
    return value, list(_events)


# --- pickles built opcode by opcode --------------------------------------------------------------


def _unicode(text: str) -> bytes:  # SHORT_BINUNICODE / BINUNICODE
    data = text.encode()
    if len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


def _global(module: str, name: str, *, stack: bool) -> bytes:
    """Pushes the global `module`.`name`: STACK_GLOBAL (protocols 4-5) or GLOBAL (0-3)."""
    if stack:
        return _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _data(value: Any) -> bytes:
    """Pushes `value`: its protocol-2 pickle (any global in it is named by GLOBAL), less PROTO
    and STOP. Its memo indices are its own: nothing else in these pickles uses the memo."""
    data = pickle.dumps(value, protocol=2)
    assert data[:2] == b"\x80\x02" and data[-1:] == pickle.STOP
    return data[2:-1]


CALL_OPCODES = {
    "REDUCE": pickle.REDUCE,  # callable(*args)
    "NEWOBJ": pickle.NEWOBJ,  # cls.__new__(cls, *args)
    "NEWOBJ_EX": pickle.EMPTY_DICT + pickle.NEWOBJ_EX,  # cls.__new__(cls, *args, **{})
}


def _call(target: bytes, args: tuple, opcode: str, *, stack: bool) -> bytes:
    """A pickle whose whole value is the call of what `target` pushes, with `args`."""
    proto = b"\x80\x04" if stack else b"\x80\x02"
    return proto + target + _data(args) + CALL_OPCODES[opcode] + pickle.STOP


# --- every allowed class, built with hostile arguments, touches nothing ------------------------

PROBE = f"/tmp/distrain-allowlist-probe-{uuid.uuid4().hex}"
"""A path no test creates: a PosixPath naming it must not create it."""

_DCP = dcp_metadata
_PROPERTIES = _DCP.TensorProperties(torch.float64, torch.sparse_coo, True)
_CHUNK = _DCP.ChunkStorageMetadata(torch.Size([0]), torch.Size([2**62]))
_LEAK = _StorageInfo("/dev/zero", 0, 2**62)
_INDEX = _DCP.MetadataIndex("/proc/self/mem", torch.Size([0]), 2**62)
_BYTES = _DCP.BytesStorageMetadata()

# id -> (the name the pickle uses, the arguments, what REDUCE must give: a value or an exception)
HOSTILE: dict[str, tuple[tuple[str, str], tuple, Any]] = {
    "OrderedDict_urls": (
        ("collections", "OrderedDict"),
        ([("/etc/passwd", "http://evil.example/payload")],),
        collections.OrderedDict([("/etc/passwd", "http://evil.example/payload")]),
    ),
    "OrderedDict_command": (("collections", "OrderedDict"), ("rm -rf /",), ValueError),
    "PosixPath_etc_passwd": (
        ("pathlib", "PosixPath"),
        ("/etc/passwd",),
        pathlib.Path("/etc/passwd"),
    ),
    "PosixPath_probe": (("pathlib", "PosixPath"), (PROBE,), pathlib.Path(PROBE)),
    "PosixPath_home": (  # not expanded: no passwd database is read
        ("pathlib", "PosixPath"),
        ("~root/.ssh/authorized_keys",),
        pathlib.Path("~root/.ssh/authorized_keys"),
    ),
    "PosixPath_parent": (  # not resolved: no link is followed
        ("pathlib", "PosixPath"),
        ("/proc/self/cwd", "../../etc", "shadow"),
        pathlib.Path("/proc/self/cwd/../../etc/shadow"),
    ),
    "Size_huge": (("torch", "Size"), ((2**62,) * 4,), torch.Size([2**62] * 4)),
    # Kept as a Python int (torch refuses such a size where it is used): data, nothing run.
    "Size_beyond_int64": (("torch", "Size"), ((2**64, -1),), torch.Size([2**64, -1])),
    "Size_text": (("torch", "Size"), (("/etc/passwd",),), TypeError),
    "get_layout_strided": (
        ("torch.serialization", "_get_layout"),
        ("torch.strided",),
        torch.strided,
    ),
    "get_layout_code": (
        ("torch.serialization", "_get_layout"),
        (f"__import__('os').system('touch {PROBE}')",),
        UnsafeCheckpoint,
    ),
    "get_layout_dotted": (
        ("torch.serialization", "_get_layout"),
        ("torch.serialization.load",),
        UnsafeCheckpoint,
    ),
    "get_layout_not_text": (
        ("torch.serialization", "_get_layout"),
        (["torch.strided"],),
        UnsafeCheckpoint,
    ),
    "_StorageInfo_outside": (
        (FS, "_StorageInfo"),
        ("../../../etc/passwd", 0, 2**62),
        _StorageInfo("../../../etc/passwd", 0, 2**62),
    ),
    "BytesStorageMetadata": ((DCP, "BytesStorageMetadata"), (), _BYTES),
    "ChunkStorageMetadata_huge": (
        (DCP, "ChunkStorageMetadata"),
        (torch.Size([0]), torch.Size([2**62])),
        _CHUNK,
    ),
    "Metadata_devices": (  # built; decode_metadata then refuses its storage path (security tests)
        (DCP, "Metadata"),
        ({"/dev/zero": _BYTES}, "http://evil.example/", {_INDEX: _LEAK}),
        _DCP.Metadata({"/dev/zero": _BYTES}, "http://evil.example/", {_INDEX: _LEAK}),
    ),
    "MetadataIndex_proc": (
        (DCP, "MetadataIndex"),
        ("/proc/self/mem", torch.Size([0]), 2**62),
        _INDEX,
    ),
    "StorageMeta_shell": (
        (DCP, "StorageMeta"),
        ("s3://bucket/../../other-run", "$(reboot)", "`id`", ["os.system"]),
        _DCP.StorageMeta("s3://bucket/../../other-run", "$(reboot)", "`id`", ["os.system"]),
    ),
    "TensorProperties": (
        (DCP, "TensorProperties"),
        (torch.float64, torch.sparse_coo, True),
        _PROPERTIES,
    ),
    "TensorStorageMetadata_huge": (
        (DCP, "TensorStorageMetadata"),
        (_PROPERTIES, torch.Size([2**62]), [_CHUNK]),
        _DCP.TensorStorageMetadata(_PROPERTIES, torch.Size([2**62]), [_CHUNK]),
    ),
    "_MEM_FORMAT_ENCODING_member": (
        (DCP, "_MEM_FORMAT_ENCODING"),
        (1,),
        _DCP._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
    ),
    "_MEM_FORMAT_ENCODING_unknown": ((DCP, "_MEM_FORMAT_ENCODING"), (99,), ValueError),
    # Enum's functional API would make a new class: Enum refuses to extend one with members.
    "_MEM_FORMAT_ENCODING_new_enum": (
        (DCP, "_MEM_FORMAT_ENCODING"),
        ("Popen", "os system"),
        TypeError,
    ),
}

_LEAVES = (
    type(None), bool, int, float, str, bytes,
    torch.dtype, torch.layout, torch.memory_format, pathlib.PosixPath,
    dcp_metadata._MEM_FORMAT_ENCODING,
)  # fmt: skip
_DATACLASSES = {cls for cls in CLASSES.values() if dataclasses.is_dataclass(cls)}


def _inert(value: Any, depth: int = 0) -> bool:
    """Plain data all the way down: no class, function or other callable, no object of a type
    outside the allow-list's (a dataclass holding only its declared fields)."""
    kind = type(value)
    if depth > 20 or isinstance(value, type) or callable(value):
        return False
    if kind in _LEAVES:
        return True
    if kind is torch.Size:
        return all(type(n) is int for n in value)
    if kind in (tuple, list):
        return all(_inert(v, depth + 1) for v in value)
    if kind in (dict, collections.OrderedDict):
        return all(_inert(k, depth + 1) and _inert(v, depth + 1) for k, v in value.items())
    if kind in _DATACLASSES:
        fields = {f.name for f in dataclasses.fields(kind)}
        return set(vars(value)) <= fields and all(
            _inert(v, depth + 1) for v in vars(value).values()
        )
    return False


def test_every_allowed_class_is_covered_here():
    assert {key for key, _, _ in HOSTILE.values()} == set(CLASSES)


@pytest.mark.parametrize("opcode", list(CALL_OPCODES))
@pytest.mark.parametrize("case", list(HOSTILE))
def test_building_an_allowed_class_with_hostile_arguments_touches_nothing(case, opcode):
    key, args, expected = HOSTILE[case]
    for stack in (False, True):
        value, events = _watched(_call(_global(*key, stack=stack), args, opcode, stack=stack))
        where = (case, opcode, "STACK_GLOBAL" if stack else "GLOBAL")
        assert events == [], (where, events)
        assert not pathlib.Path(PROBE).exists(), where
        if opcode == "REDUCE":  # exactly what the class itself gives for these arguments
            if isinstance(expected, type) and issubclass(expected, Exception):
                assert type(value) is expected, (where, value)
            else:
                assert type(value) is type(expected) and value == expected, (where, value)
        if isinstance(value, Exception):
            # Refusing the arguments is safe (decode_metadata reports it as unreadable); what
            # mattered is that nothing ran first.
            continue
        # cls.__new__ without __init__ may leave a dataclass empty: inert all the same.
        assert _inert(value), (where, value)


# --- anything else is refused before it is reached -----------------------------------------------


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("subprocess", "Popen"),
        ("subprocess", "run"),
        ("os", "system"),
        ("posix", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("pathlib", "Path.open"),
        ("pathlib", "PosixPath.write_text"),
        (FS, "os.system"),
        (DCP, "Metadata.__init__"),
        ("torch", "Size.__new__"),
        ("collections", "OrderedDict.fromkeys"),
        ("torch", "load"),
        ("torch.serialization", "load"),
        (metadata.__name__, "LayoutByName"),  # allowed only under torch's name for it
    ],
)
def test_a_pickle_naming_anything_else_is_refused_before_it_is_reached(module, name):
    for stack in (False, True):
        for opcode in CALL_OPCODES:
            refused, events = _watched(
                _call(_global(module, name, stack=stack), (f"touch {PROBE}",), opcode, stack=stack)
            )
            assert isinstance(refused, UnsafeCheckpoint), (stack, opcode, refused)
            assert re.search(f"^refers to {re.escape(f'{module}.{name}')}, ", str(refused))
            assert events == [], (stack, opcode, events)
    assert not pathlib.Path(PROBE).exists()


# What sits on the stack when the call opcode comes: an allowed value that is not a class, or an
# instance a previous call built. Each pushes it, by GLOBAL or by REDUCE.
NOT_CLASSES = {
    "dtype": lambda stack: _global("torch", "float32", stack=stack),
    "layout": lambda stack: (
        _global("torch.serialization", "_get_layout", stack=stack)
        + _data(("torch.strided",))
        + pickle.REDUCE
    ),
    "enum_member": lambda stack: (
        _global(DCP, "_MEM_FORMAT_ENCODING", stack=stack) + _data((0,)) + pickle.REDUCE
    ),
    "path": lambda stack: (
        _global("pathlib", "PosixPath", stack=stack) + _data(("/bin/sh",)) + pickle.REDUCE
    ),
    "dict": lambda stack: _global("collections", "OrderedDict", stack=stack) + b")R",
    "text": lambda stack: _unicode("os.system"),
}


@pytest.mark.parametrize("opcode", list(CALL_OPCODES))
@pytest.mark.parametrize("target", list(NOT_CLASSES))
def test_only_an_allowed_class_can_be_called(target, opcode):
    for stack in (False, True):
        push = NOT_CLASSES[target](stack)
        refused, events = _watched(_call(push, (f"touch {PROBE}",), opcode, stack=stack))
        assert isinstance(refused, UnsafeCheckpoint), (stack, refused)
        assert f"{opcode} calls " in str(refused) and "may not call" in str(refused), refused
        assert events == [], events
    assert not pathlib.Path(PROBE).exists()


# --- what a refusal says, and what decode_metadata accepts ----------------------------------------


@pytest.mark.parametrize(
    "name", ["system\nERROR step 7: loss is nan", "system\r\x1b[2KOK", "syst\u2028em"], ids=repr
)
def test_a_refusal_is_one_printable_line_whatever_the_pickle_names(name):
    """A name holding a newline or a terminal escape would forge lines in the run's log."""
    for data in (
        b"\x80\x04" + _global("os", name, stack=True) + pickle.STOP,
        # The damage path too: Enum's own error quotes a keyword name the pickle chose raw.
        b"\x80\x04"
        + _global(DCP, "_MEM_FORMAT_ENCODING", stack=True)
        + _data((0,))
        + pickle.EMPTY_DICT
        + _unicode(name)
        + pickle.NONE
        + pickle.SETITEM
        + pickle.NEWOBJ_EX
        + pickle.STOP,
    ):
        with pytest.raises(CheckpointError) as refused:
            decode_metadata(data)
        assert str(refused.value).isprintable() and str(refused.value).isascii(), refused.value


def test_metadata_without_its_entry_index_is_refused():
    """NEWOBJ without BUILD makes a Metadata with no `state_dict_metadata`; every reader of
    metadata (the export among them) would fail on it with an AttributeError."""
    empty = b"\x80\x02" + _global(DCP, "Metadata", stack=False) + b")\x81."
    listed = b"\x80\x02" + _global(DCP, "Metadata", stack=False) + b")\x81}"
    listed += _unicode("state_dict_metadata") + b"]sb."
    for data in (empty, listed):
        with pytest.raises(CheckpointError, match="entry index is missing or not a mapping"):
            decode_metadata(data)


def test_a_real_checkpoints_metadata_decodes_under_the_watch(tmp_path):
    """The watch raises nothing on a real DCP `.metadata` (tensors of several dtypes, bytes,
    nested entries): what it records in the tests above would be the hostile pickle's doing."""
    state = {
        "w": torch.zeros(3, 4),
        "nested": {"b": torch.ones(2, dtype=torch.bfloat16), "i": torch.arange(5)},
        "blob": b"bytes",
        "step": 7,
    }
    dcp.save(state, checkpoint_id=str(tmp_path))
    data = (tmp_path / ".metadata").read_bytes()
    value, events = _watched(data)
    assert isinstance(value, dcp_metadata.Metadata) and events == [], (value, events)
    assert set(value.state_dict_metadata) == {"w", "nested.b", "nested.i", "blob", "step"}
    assert _inert(value.state_dict_metadata)
    assert decode_metadata(data).state_dict_metadata == value.state_dict_metadata


def test_the_watch_sees_what_a_dangerous_entry_would_do(monkeypatch, tmp_path):
    """The audit above is not blind: with `subprocess.Popen` added to the table (the mutation
    of the review), decoding runs a program, and the watch records it."""
    monkeypatch.setitem(metadata.ALLOWED, ("subprocess", "Popen"), subprocess.Popen)
    monkeypatch.setattr(metadata, "_CALLABLE", metadata._CALLABLE | {subprocess.Popen})
    marker = tmp_path / "ran"
    popen = _global("subprocess", "Popen", stack=False)
    process, events = _watched(_call(popen, (["touch", str(marker)],), "REDUCE", stack=False))
    process.wait()
    assert "subprocess.Popen" in events and marker.exists()
