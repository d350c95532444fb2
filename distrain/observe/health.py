"""Numerical health: skipping or stopping on non-finite gradients, and flagging loss spikes.

`NonFiniteGuard.step_ok` decides whether this step's optimizer update may run. The decision reads
the global gradient norm, which clip_grad_norm has already all-reduced over every rank, so all
ranks see the same value and agree without another collective. When gradients stay local, as in
1-bit Adam's compressed phase, one all-reduce makes them agree: of a vector with one slot per
rank, each rank setting its own, so that a skip names the ranks whose own gradients were
non-finite (a warning in the rank logs, which `distrain diagnose` reports). With the norm already
agreed no rank is named: that would take another collective, and gradients synchronized in
backward hold a NaN on every rank wherever it arose. It costs one host sync
per step: skipping torch.optim's update on the device alone would need its fused kernels'
found_inf path, which not every optimizer here has (ZeRO-1, 1-bit Adam). The sync waits for the
clipped gradients, which the optimizer's kernels wait for anyway; fp16 runs already pay the same
sync inside GradScaler.step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from distrain.errors import DistrainError
from distrain.observe.logs import LOGGER_NAME
from distrain.observe.observer import Row, StepObserver

_log = logging.getLogger(LOGGER_NAME)


class NonFiniteError(DistrainError):
    """Training stopped on a non-finite loss or gradient (training.nonfinite)."""


def _clean_name(name: str) -> str:
    """A parameter's name as the plain model calls it (without DDP's and wrappers' prefixes)."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def first_nonfinite(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """The name of the first parameter whose (local) gradient holds a NaN or an infinity."""
    for name, p in named_params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if not bool(torch.isfinite(grad).all()):
            return _clean_name(name)
    return None


class NonFiniteGuard(StepObserver):
    """training.nonfinite: "skip" (no update, counted) or "stop"; either way a run of
    `max_in_a_row` non-finite steps stops training."""

    def __init__(self, action: str, *, max_in_a_row: int, rank: int, world_size: int):
        self.action, self.max_in_a_row = action, max_in_a_row
        self.rank, self.world_size = rank, world_size
        self.skipped = 0
        self.in_a_row = 0

    def step_ok(
        self,
        grad_norm: torch.Tensor,
        *,
        step: int,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        agreed: bool,
    ) -> bool:
        """True if the update may run. `agreed`: grad_norm is the same on every rank."""
        bad = ~torch.isfinite(grad_norm)
        flags = None
        if not agreed and self.world_size > 1:
            flags = torch.zeros(self.world_size, dtype=torch.int32, device=grad_norm.device)
            flags[self.rank] = bad.to(torch.int32)
            dist.all_reduce(flags)
            bad = flags.any()
        if not bool(bad):  # the one host sync (see the module docstring)
            self.in_a_row = 0
            return True
        if flags is not None:
            ranks = ", ".join(str(r) for r in flags.nonzero().flatten().tolist())
            _log.warning(
                "non-finite gradients at step %d on rank(s) %s (gradients kept local)", step, ranks
            )
        self.skipped += 1
        self.in_a_row += 1
        if self.action == "stop" or self.in_a_row >= self.max_in_a_row:
            self._stop(step, grad_norm, named_params)
        return False

    def logged(self, row: Row, *, steps: int) -> None:
        row["nonfinite_skipped"] = self.skipped

    def _stop(
        self,
        step: int,
        grad_norm: torch.Tensor,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
    ) -> None:
        mine = first_nonfinite(named_params)
        found: list[str | None] = [mine]
        if self.world_size > 1 and dist.is_initialized():
            found = [None] * self.world_size
            dist.all_gather_object(found, mine)
        where = next(
            (f"first on rank {r} in parameter {name}" for r, name in enumerate(found) if name),
            "no gradient holds one (the norm overflowed)",
        )
        why = (
            f"{self.in_a_row} steps in a row (training.max_nonfinite_steps = {self.max_in_a_row})"
            if self.action == "skip"
            else 'training.nonfinite = "stop"'
        )
        raise NonFiniteError(
            f"non-finite gradient at step {step} (grad norm {float(grad_norm)}); {where}; "
            f'stopping: {why}. Lower optim.lr, or set training.nonfinite = "skip"'
        )


class LossSpikes(StepObserver):
    """Flags a logged loss above `factor` x the running mean of earlier logged losses (an
    exponential moving average; non-finite losses leave it unchanged)."""

    def __init__(self, factor: float, *, decay: float = 0.9):
        self.factor, self.decay = factor, decay
        self.mean: float | None = None

    def update(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        spike = self.mean is not None and loss > self.factor * self.mean
        self.mean = loss if self.mean is None else self.decay * self.mean + (1 - self.decay) * loss
        return spike

    def logged(self, row: Row, *, steps: int) -> None:
        row["loss_spike"] = self.update(row["loss"])
