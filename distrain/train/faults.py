"""`debug.*` fault injection inside a training step, for tests and chaos runs: a crash (an
exception, or SIGKILL), one NaN gradient, and a hang inside backward. Each acts only at its step,
on its rank and, for the crash and the hang, in its attempt of an elastic run. `params` is
called only when the fault fires, so the check costs nothing in the other steps."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from distrain.config.debug import DebugConfig
from distrain.observe.heartbeat import attempt_number


class InjectedFailure(RuntimeError):
    """The crash that debug.fail_at_step asks for."""


def maybe_inject_failure(debug: DebugConfig, step: int, rank: int, log: logging.Logger) -> None:
    """debug.fail_at_step: crash as `step` begins."""
    if not debug.fail_at_step or step != debug.fail_at_step:
        return
    if debug.fail_rank not in (-1, rank) or attempt_number() != debug.fail_attempt:
        return
    message = f"debug.fail_at_step: rank {rank} crashes at step {step}"
    log.error("%s (%s)", message, debug.fail_mode)
    if debug.fail_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFailure(message)


def maybe_inject_nan(
    debug: DebugConfig, step: int, rank: int, params: Callable[[], Iterable[nn.Parameter]]
) -> None:
    """debug.nan_at_step: one NaN in the first gradient of this rank, after backward."""
    if debug.nan_at_step != step or debug.nan_rank not in (-1, rank):
        return
    grad = next(p.grad for p in params() if p.grad is not None)
    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.nan


def maybe_inject_hang(
    debug: DebugConfig,
    step: int,
    rank: int,
    params: Callable[[], Iterable[nn.Parameter]],
    log: logging.Logger,
) -> None:
    """debug.hang_at_step: block forever inside this step's backward pass (a gradient hook on the
    first parameter never returns), the way a stuck kernel or a deadlock would."""
    if not debug.hang_at_step or step != debug.hang_at_step:
        return
    if debug.hang_rank not in (-1, rank) or attempt_number() != debug.fail_attempt:
        return
    log.error("debug.hang_at_step: rank %d hangs in backward of step %d", rank, step)

    def sleep_forever(grad: torch.Tensor) -> torch.Tensor:
        while True:
            time.sleep(3600)

    next(p for p in params() if p.requires_grad).register_hook(sleep_forever)
