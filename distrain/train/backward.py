"""How a step's gradients are made from its micro-batches: the strategy the step calls between
its data and its optimizer update. `PlainBackward` runs the model's forward and backward once,
synchronizing gradients where the gradient plan wants them; out-of-memory recovery
(`oom.RecoveringBackward`) is the other strategy, chosen by training.oom_recovery."""

from __future__ import annotations

from typing import Protocol

import torch

from distrain.optim.gradient_plan import GradientPlan
from distrain.parallel.model import ParallelModel
from distrain.parallel.scaler import AgreedGradScaler

Batch = tuple[torch.Tensor, ...]


class Backward(Protocol):
    def __call__(
        self, batches: list[Batch], target_share: torch.Tensor, *, step: int, report_loss: bool
    ) -> torch.Tensor:
        """Forward and backward of `batches` (this rank's micro-batches of optimizer step
        `step`); returns the loss (`ParallelModel.forward_backward`), gradients left in the
        parameters, synchronized as the gradient plan wants them."""
        ...


class PlainBackward:
    """One forward and backward over the micro-batches: an error ends the run."""

    def __init__(self, model: ParallelModel, scaler: AgreedGradScaler, plan: GradientPlan):
        self.model, self.scaler, self.plan = model, scaler, plan

    def __call__(
        self, batches: list[Batch], target_share: torch.Tensor, *, step: int, report_loss: bool
    ) -> torch.Tensor:
        return self.model.forward_backward(
            batches,
            self.scaler.scale,
            sync=self.plan.sync_in_backward(),
            report_loss=report_loss,
            target_share=target_share,
        )
