"""Stopping on request: SIGTERM, SIGUSR1 (what Slurm sends before a time limit or preemption) and
SIGINT (Ctrl-C) make every rank finish its step, save a `preempt` checkpoint and exit with
`EXIT_PREEMPTED`, within `checkpoint.preempt_grace_s`.

Owns three things:
- `StopSignals`: the workers' handlers. The first signal only sets a flag (and arms a timer that
  ends the process once the grace period is spent, even if its main thread is stuck in a
  collective). A second signal aborts at once: the checkpoint being written then lacks its
  manifest, so it never counts, and earlier checkpoints are untouched.
- `StopAgreement`: which step every rank stops after. Signals reach ranks at different times, so
  each rank contributes its flag to a MAX all-reduce that is started asynchronously after a step
  and read after the next one: every rank reads the same value at the same step, and the read
  never waits on the device (the flag is a CPU tensor on a gloo group of its own, see
  `device.host_group`), so a CUDA/NCCL run pays no host sync for it.
- `launcher_outcome`: what `distrain train`'s launcher reports once its workers are gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from distrain.checkpoint.manifest import committed, step_name
from distrain.checkpoint.storage import Storage
from distrain.errors import DistrainError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# sysexits' EX_TEMPFAIL, "try again later": the job stopped early on request with a committed
# checkpoint, and starting it again resumes from there (`distrain slurm` requeues on it).
EXIT_PREEMPTED = 75
# The same signal often arrives twice at once: Slurm signals every process of a step and
# torchrun's agent forwards its own copy to the workers. Copies within this window are one
# request; a signal after it is a second request, which aborts.
DUPLICATE_WINDOW_S = 1.0


class Preempted(DistrainError):
    """Stopped by a signal after committing a checkpoint to resume from: not a failure."""

    exit_code = EXIT_PREEMPTED
    label = "preempted"


class StopSignals:
    """Installs the stop handlers in this (main) thread; `requested` is the first signal's
    number, or 0 while none came."""

    def __init__(self, *, grace_s: float, logger: logging.Logger):
        self.grace_s, self.log = grace_s, logger
        self.requested = 0
        self.first_at = 0.0
        self.timer: threading.Timer | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if not self.requested:
            self.requested, self.first_at = signum, now
            self.log.warning(
                "%s: finishing this step, then saving a preempt checkpoint (grace %.0fs)",
                name,
                self.grace_s,
            )
            self.timer = threading.Timer(self.grace_s, self._out_of_time)
            self.timer.daemon = True
            self.timer.start()
        elif now - self.first_at > DUPLICATE_WINDOW_S:
            self.log.error("second stop signal (%s): aborting without a checkpoint", name)
            _flush(self.log)
            os._exit(128 + signum)

    def _out_of_time(self) -> None:
        self.log.error(
            "checkpoint.preempt_grace_s (%.0fs) spent before the preempt checkpoint was "
            "committed: exiting without it",
            self.grace_s,
        )
        _flush(self.log)
        os._exit(128 + self.requested)

    def close(self) -> None:
        """Disarm the grace timer and put the previous handlers back (tests run several
        trainers in one process)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _flush(logger: logging.Logger) -> None:
    for handler in logger.handlers:
        handler.flush()


class StopAgreement:
    """Decides, identically on every rank, after which step to stop.

    `stop_now()` is called once after every step. With more than one rank it returns the MAX of
    the flags all ranks contributed one call earlier, so a stop is agreed one step after the
    first rank saw its signal; with one rank it returns this rank's flag at once.
    """

    def __init__(self, signals: StopSignals, group: dist.ProcessGroup | None):
        self.signals, self.group = signals, group
        self.pending: tuple[torch.Tensor, dist.Work] | None = None

    def stop_now(self) -> bool:
        if self.group is None:
            return bool(self.signals.requested)
        agreed = False
        if self.pending is not None:
            flag, work = self.pending
            work.wait()
            agreed = bool(flag[0])
        flag = torch.tensor([self.signals.requested], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (flag, work)
        return agreed

    def close(self) -> None:
        """Finish the reduction in flight; every rank must call it (after its last step)."""
        if self.pending is not None:
            self.pending[1].wait()
            self.pending = None

    @property
    def signal_name(self) -> str:
        """The stop signal this rank saw, or that another rank saw."""
        requested = self.signals.requested
        return signal.Signals(requested).name if requested else "a stop signal on another rank"


def preempted_message(step: int, total_steps: int, signal_name: str) -> str:
    return (
        f"stopped by {signal_name} after step {step} of {total_steps}: checkpoint "
        f"{step_name(step)} committed; start the same command again to resume from it"
    )


def launcher_outcome(storage: Storage, *, since: float, signum: int | None) -> DistrainError:
    """The launcher's verdict once its workers stopped on a signal (`signum`, or None when it
    reached only workers): `Preempted` when a preempt checkpoint was committed since `since` (a
    time.time()), else an error that says what the run can resume from."""
    entries = committed(storage)
    newest = entries[-1] if entries else None
    name = signal.Signals(signum).name if signum else "a signal to the workers"
    if (
        newest is not None
        and newest.manifest.get("kind") == "preempt"
        and newest.manifest.get("time", 0.0) >= since
    ):
        return Preempted(
            f"stopped by {name}: preempt checkpoint {step_name(newest.step)} committed; start "
            "the same command again to resume from it"
        )
    resume = f"the newest checkpoint is {step_name(newest.step)}" if newest else "no checkpoint"
    error = DistrainError(
        f"stopped by {name} before a preempt checkpoint was committed ({resume}); raise "
        "checkpoint.preempt_grace_s if the workers needed longer"
    )
    if signum:
        error.exit_code = 128 + signum
    return error
