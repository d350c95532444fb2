"""Every `debug.*` fault injection of a training run, in one place, for tests and chaos runs:
`FaultInjection` is built once from the `[debug]` section and this rank, and the loop calls it
at the points where a real fault would strike:

- as a step begins: a crash (an exception, or SIGKILL), a slow rank (a sleep every step), a
  hang inside that step's backward (a gradient hook that never returns);
- inside a step: an out-of-memory error before a micro-batch, and one NaN gradient after
  backward;
- after a save: one shard of the committed checkpoint damaged, as bit rot would;
- on a stop signal: a delay before the preempt checkpoint commits.

Each acts only at its step, on its rank and, for the crash, the hang and the damaged
checkpoint, in its attempt of an elastic run (debug.fail_attempt). `params` is called only when
a fault fires, so the checks cost nothing in the other steps. The automatic micro-batch search
injects its own out-of-memory errors (`debug.oom_at_micro_batch`, see autobatch.py): it runs
before the first step.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import step_name
from distrain.config.debug import DebugConfig
from distrain.observe.heartbeat import attempt_number

Params = Callable[[], Iterable[nn.Parameter]]


HOLD_S = 3600.0


class InjectedFailure(RuntimeError):
    """The crash that debug.fail_at_step asks for."""


class FaultInjection:
    """The faults `[debug]` asks this rank to suffer (none by default)."""

    def __init__(self, debug: DebugConfig, *, rank: int, logger: logging.Logger):
        self.debug, self.rank, self.log = debug, rank, logger
        self._oom_fired = False

    def _mine(self, rank_field: int) -> bool:
        return rank_field in (-1, self.rank)

    def step_begins(self, step: int) -> None:
        """debug.fail_at_step: crash as `step` begins."""
        d = self.debug
        if not d.fail_at_step or step != d.fail_at_step:
            return
        if not self._mine(d.fail_rank) or attempt_number() != d.fail_attempt:
            return
        message = f"debug.fail_at_step: rank {self.rank} crashes at step {step}"
        self.log.error("%s (%s)", message, d.fail_mode)
        if d.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFailure(message)

    def step_runs(self, step: int, params: Params) -> None:
        """In `step`'s data phase (where the straggler timer counts): debug.slow_rank sleeps
        debug.slow_ms; debug.hang_at_step blocks forever inside this step's backward pass (a
        gradient hook on the first parameter never returns), the way a stuck kernel or a
        deadlock would."""
        d = self.debug
        if d.slow_rank == self.rank:
            time.sleep(d.slow_ms / 1000)
        if not d.hang_at_step or step != d.hang_at_step:
            return
        if not self._mine(d.hang_rank) or attempt_number() != d.fail_attempt:
            return
        self.log.error("debug.hang_at_step: rank %d hangs in backward of step %d", self.rank, step)

        def sleep_forever(grad: torch.Tensor) -> torch.Tensor:
            while True:
                time.sleep(3600)

        next(p for p in params() if p.requires_grad).register_hook(sleep_forever)

    def out_of_memory_hook(self, step: int, num_micro_batches: int) -> Callable[[int], None]:
        """debug.oom_at_step: a hook run before each micro-batch that raises an out-of-memory
        error inside that step, once. It strikes before the second micro-batch (or the first,
        if there is one), so gradients of a finished micro-batch exist and must be discarded, as
        with a real mid-step failure."""

        def before_micro_batch(index: int) -> None:
            if self._oom_fired or not self._mine(self.debug.oom_rank):
                return
            if step == self.debug.oom_at_step and index == min(1, num_micro_batches - 1):
                self._oom_fired = True
                raise torch.OutOfMemoryError("debug.oom_at_step: injected out-of-memory error")

        return before_micro_batch

    def after_backward(self, step: int, params: Params) -> None:
        """debug.nan_at_step: one NaN in the first gradient of this rank."""
        if self.debug.nan_at_step != step or not self._mine(self.debug.nan_rank):
            return
        grad = next(p.grad for p in params() if p.grad is not None)
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.nan

    def after_save(self, step: int, checkpointer: Checkpointer) -> None:
        """debug.corrupt_checkpoint_step: once the checkpoint of `step` is committed, rank 0
        flips the first byte of one of its shard files, as bit rot would; in attempt
        debug.fail_attempt only, so the checkpoint a restarted run saves again at that step
        stays whole."""
        d = self.debug
        if d.corrupt_checkpoint_step != step or attempt_number() != d.fail_attempt:
            return
        checkpointer.wait()
        if self.rank != 0:
            return
        storage = checkpointer.storage
        path = storage.path(step_name(step))
        shard = next(n for n in storage.listdir(path) if n.endswith(".distcp"))
        data = bytearray(storage.fs.cat_file(f"{path}/{shard}"))
        data[0] ^= 0xFF
        storage.fs.pipe_file(f"{path}/{shard}", bytes(data))
        self.log.warning("debug.corrupt_checkpoint_step: damaged %s", f"{path}/{shard}")

    def before_commit(self, step: int, kind: str) -> None:
        """Between a save's writing and its commit (in the writer thread of a background save):
        debug.preempt_delay_s waits there for a preempt save; debug.hold_checkpoint_step holds
        the save of that step for an hour, in attempt debug.fail_attempt only."""
        d = self.debug
        if kind == "preempt" and d.preempt_delay_s:
            self.log.warning(
                "debug.preempt_delay_s: waiting %.1fs before committing", d.preempt_delay_s
            )
            time.sleep(d.preempt_delay_s)
        if d.hold_checkpoint_step == step and attempt_number() == d.fail_attempt:
            self.log.warning(
                "debug.hold_checkpoint_step: holding checkpoint step %d uncommitted", step
            )
            time.sleep(HOLD_S)
