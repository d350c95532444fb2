"""torch's flight recorder: a ring buffer of the last collectives each rank issued (kind, process
group, sequence number, sizes), kept by c10d itself for gloo and NCCL groups alike in torch 2.13.

`enable` sets its environment before the first process group exists (the buffer is sized from
TORCH_FR_BUFFER_SIZE then); on NCCL it also asks ProcessGroupNCCL to dump the buffer on a
collective timeout into <run_dir>/flight/. `dump` writes this rank's buffer as JSON when the
watchdog finds a hang and returns what the rank issued last, which names the collective the
others wait in (torch's `torchfrtrace` analyzer also reads NCCL's pickled dumps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distrain.files import make_dir, write_atomic

BUFFER_ENTRIES = 2000
FLIGHT_DIR = "flight"


def flight_dir(run_dir: Path) -> Path:
    return Path(run_dir) / FLIGHT_DIR


def enable(run_dir: Path, *, nccl: bool) -> None:
    """Turn the recorder on unless the user set its variables already."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    if nccl:
        make_dir(run_dir, FLIGHT_DIR)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        # ProcessGroupNCCL appends the rank to this prefix.
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(flight_dir(run_dir) / "nccl_rank"))


def _trace_json(nccl: bool) -> str:
    from torch._C import _distributed_c10d as c10d

    text = c10d._dump_nccl_trace_json() if nccl else c10d._dump_fr_trace_json()
    return text.decode() if isinstance(text, bytes) else text


def summarize(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The last collective in `trace` ({"op", "seq", "group"}) and the last sequence number
    issued per process group ("seqs"); None when nothing was recorded."""
    entries = [e for e in trace.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return None
    seqs: dict[str, int] = {}
    for e in entries:
        group = e["process_group"][0]
        seqs[group] = max(seqs.get(group, 0), int(e["collective_seq_id"]))
    last = max(entries, key=lambda e: e["record_id"])
    return {
        "op": last["profiling_name"].split(":")[-1],
        "seq": int(last["collective_seq_id"]),
        "group": last["process_group"][0],
        "group_name": last["process_group"][1],
        "seqs": seqs,
    }


def dump(run_dir: Path, rank: int, *, nccl: bool) -> dict[str, Any] | None:
    """Write flight/rank<N>.json and return `summarize` of it (None when the recorder is off or
    this torch has none)."""
    try:
        text = _trace_json(nccl)
    except (AttributeError, RuntimeError):
        return None
    write_atomic(make_dir(run_dir, FLIGHT_DIR) / f"rank{rank}.json", text)
    return summarize(json.loads(text))
