"""Read back what an offline W&B run wrote: the records of its run-ID.wandb file.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: CRC-32C, length,
type FULL/FIRST/MIDDLE/LAST; a block tail shorter than a header is padding) whose payloads
are `wandb.proto.wandb_internal_pb2.Record` messages. wandb no longer ships a reader of its own
(it moved to its Go core), so the tests read the format here."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")
FILE_HEADER = struct.Struct("<4sHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, out, parts = FILE_HEADER.size, [], []
    while pos + HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER.size:
            pos += left_in_block
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        chunk = data[pos : pos + length]
        pos += length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            out.append(b"".join([*parts, chunk]))
        elif kind == 0 and length == 0:
            pos += left_in_block - HEADER.size  # zero padding to the block's end
    return out


def read_run(run_file: Path) -> dict[str, Any]:
    """{"run_id", "history": [{key: value}], "config": {key: value}, "files": [path],
    "exit_code"} of one offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"history": [], "config": {}, "files": [], "exit_code": None}
    for payload in payloads(run_file):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["run_id"] = record.run.run_id
            run["config"].update(
                {i.key: json.loads(i.value_json) for i in record.run.config.update}
            )
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "files":
            run["files"] += [f.path for f in record.files.files]
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)
