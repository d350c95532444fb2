"""How long a collective takes from issue until its result is ready: the one place that decides
how to time communication on each device.

On CPU (gloo) a collective's future completes when the data has arrived, so the host clock
(`time.perf_counter`) read in the completion callback is the collective's time. On CUDA (NCCL) a
future completes as soon as the kernels are *queued*, so the host clock would measure launch
time; there a CUDA event is recorded on the issuing stream at issue and another on the stream
that consumes the result, and their distance is read later, at a logging step (reading it then
costs one event synchronize; nothing waits in the training step).
"""

from __future__ import annotations

import time

import torch


class CommMark:
    """One collective's (or a chain of collectives') span: `start()` at issue, `stop()` where
    its result is ready (a completion callback, or after a blocking call); `seconds()` reads
    it, waiting for the end event on CUDA."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
            self._t1: float | None = None

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000
        if self._t1 is None:
            raise RuntimeError("CommMark.seconds() before stop()")
        return self._t1 - self._t0


def start(device: torch.device) -> CommMark:
    """Mark the issue of a collective on `device` (call just before issuing it)."""
    return CommMark(device)
