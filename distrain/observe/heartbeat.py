"""Per-rank heartbeat: which step and phase this rank is in, and how far it has moved.

The training loop (and the model runner, for forward/backward) mark phases through `mark`; the
watchdog thread writes the state to <run_dir>/heartbeat/rank<N>.json (atomically replaced, so a
reader never sees half a file) every watchdog.HEARTBEAT_EVERY_S (30 s; more often under a short
hang timeout), to spare a shared file system. Other ranks' watchdogs read the files when a hang
is suspected. A file per rank in the run dir, rather than keys in the rendezvous store, survives
the job for post-mortems; across nodes it needs a shared run dir (as resuming from
<run_dir>/checkpoints does).

There is one heartbeat per process, held in a module variable, because phases are marked deep in
the model runner where the trainer's objects are not at hand. Checkpoint storage reports the
bytes it moves through `moved`: a long save or resume verification stays in one phase, and the
watchdog counts those bytes as progress too.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from distrain.files import make_dir, write_atomic

PHASES = (
    "setup",
    "data",
    "forward",
    "backward",
    "forward_backward",  # a pipeline schedule interleaves both
    "optimizer",
    "log",
    "eval",
    "checkpoint",
    "done",
)
HEARTBEAT_DIR = "heartbeat"


def heartbeat_dir(run_dir: Path) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR


def attempt_number() -> int:
    """torchrun's restart count: 0 in the first attempt (and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class Heartbeat:
    """This rank's step, phase, a counter of phase changes and the bytes checkpoint storage
    moved (together, its progress)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.path = make_dir(run_dir, HEARTBEAT_DIR) / f"rank{rank}.json"
        self.attempt = attempt_number()
        self.step = 0
        self.phase = "setup"
        self.progress = 0
        self.bytes_moved = 0

    def mark(self, phase: str, step: int | None = None) -> None:
        """Enter `phase` (of `step`, when given). Plain attribute writes: no I/O, no sync."""
        self.phase = phase
        if step is not None:
            self.step = step
        self.progress += 1

    def moved(self, nbytes: int) -> None:
        """Note `nbytes` read from or written to checkpoint storage. No lock: threads (DCP's
        writers, an async save) may lose each other's additions, but any change is progress."""
        self.bytes_moved += nbytes

    def write(self, **extra: Any) -> None:
        record = {
            "rank": self.rank,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "progress": self.progress,
            "time": time.time(),
            **extra,
        }
        write_atomic(self.path, json.dumps(record))


class PhaseListener(Protocol):
    def on_phase(self, phase: str) -> None: ...


_active: Heartbeat | None = None
_listeners: list[PhaseListener] = []


def activate(heartbeat: Heartbeat | None) -> None:
    """Make `heartbeat` the one `mark` updates (None: marks are ignored)."""
    global _active
    _active = heartbeat


def listen(listener: PhaseListener) -> None:
    """Tell `listener` (the straggler meter's compute timer, the profiler's ranges) of every
    phase change."""
    _listeners.append(listener)


def unlisten(listener: PhaseListener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def mark(phase: str, step: int | None = None) -> None:
    """Enter `phase` (of `step`, when given) in the active heartbeat, if any."""
    if _active is not None:
        _active.mark(phase, step)
    for listener in _listeners:
        listener.on_phase(phase)


def moved(nbytes: int) -> None:
    """Note `nbytes` moved to or from checkpoint storage in the active heartbeat, if any."""
    if _active is not None:
        _active.moved(nbytes)


def read_heartbeats(run_dir: Path, *, attempt: int | None = None) -> dict[int, dict[str, Any]]:
    """rank -> its last heartbeat record (only those of `attempt`, when given)."""
    beats = {}
    for path in sorted(heartbeat_dir(run_dir).glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if attempt is None or record.get("attempt") == attempt:
            beats[int(record["rank"])] = record
    return beats
