"""Straggler detection: each rank's compute time over the logging window, gathered at logged steps.

A rank's compute time is the time it spends loading data and in forward passes (the phases the
heartbeat marks as "data" and "forward"). Under DDP no collective runs there, so a rank that is
slow shows up slow, while the ranks that wait for it wait in backward and in the gradient-norm
all-reduce, outside what is counted. (Under FSDP, tp or pp the forward includes their
all-gathers and activations exchange, and the first step's forward DDP's bucket rebuild, which
follows distrain's settling backward: the figure is then an upper bound.) On CUDA the intervals
are CUDA events on the current stream, read only at the logging step, so the hot loop gains no
host sync.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from distrain.observe import heartbeat
from distrain.observe.observer import Row, StepObserver

COMPUTE_PHASES = ("data", "forward")


class ComputeTimer:
    """Sums the intervals spent in COMPUTE_PHASES; `on_phase` is fed by heartbeat.mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._open: float | torch.cuda.Event | None = None
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_phase(self, phase: str) -> None:
        computing = phase in COMPUTE_PHASES
        if computing and self._open is None:
            self._open = self._now()
        elif not computing and self._open is not None:
            end = self._now()
            if self.cuda:
                self._events.append((self._open, end))
            else:
                self._seconds += end - self._open
            self._open = None

    def take(self) -> float:
        """Seconds counted since the last call (syncs on the recorded CUDA events)."""
        seconds = self._seconds + sum(s.elapsed_time(e) / 1000 for s, e in self._events)
        self._seconds, self._events = 0.0, []
        return seconds


def straggler_metrics(compute_s: float, device: torch.device) -> dict[str, float | int]:
    """Gather every rank's compute time: the slowest rank and its ratio to the median (a
    collective over the world: call it on every rank, at logged steps)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = torch.tensor([compute_s], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, mine)
    else:
        gathered = [mine]
    times = torch.cat(gathered).tolist()
    slowest = max(range(world), key=lambda r: times[r])
    median = statistics.median(times)
    return {
        "slowest_rank": slowest,
        "straggler_ratio": times[slowest] / median if median > 0 else 1.0,
        "compute_s_max": times[slowest],
    }


class Stragglers(StepObserver):
    """At each logged step, every rank's compute time over the window, gathered: the slowest
    rank, its ratio to the median and its seconds per step join the row, and rank 0 warns when
    the ratio exceeds `ratio`."""

    def __init__(self, device: torch.device, *, ratio: float, rank: int, logger: logging.Logger):
        self.device, self.ratio, self.rank, self.log = device, ratio, rank, logger
        self.timer = ComputeTimer(device)
        heartbeat.listen(self.timer)

    def logged(self, row: Row, *, steps: int) -> None:
        found = straggler_metrics(self.timer.take() / steps, self.device)
        if found["straggler_ratio"] > self.ratio and self.rank == 0:
            self.log.warning(
                "straggler: rank %d computes %.2fx the median rank (%.3f s per step in data "
                "and forward)",
                found["slowest_rank"],
                found["straggler_ratio"],
                found["compute_s_max"],
            )
        row.update(found)

    def close(self) -> None:
        heartbeat.unlisten(self.timer)
