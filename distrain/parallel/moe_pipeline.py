"""MoE layers inside pipeline stages: their balancing losses and statistics, per micro-batch.

A pipeline schedule computes the loss on the last stage only, and runs several micro-batches'
forwards before their backwards, so the accumulation loop's way (add the model's balancing
term to each micro-batch's loss) does not apply. Instead each stage's forward hands its MoE
layers' term to the backward through its own output: an identity whose backward also gives
the term a gradient of 1, as if it had been added to that micro-batch's loss (Megatron-LM's
auxiliary-loss scaler works the same way). The schedule's gradient scaling (1 / micro-batches)
then applies to it as to the loss. The same hook records the micro-batch's statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distrain.parallel.moe_stats import MoEStats


class _JoinBackward(torch.autograd.Function):
    """`output` unchanged; in backward, `term` gets gradient 1."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_shape = term.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.term_shape, device=grad.device)


def join_balancing_losses(stage: nn.Module, stats: MoEStats) -> None:
    """Hook `stage` (this rank's one stage; layout.py allows one per rank with MoE) so that
    each training forward records its MoE statistics and its balancing term joins the
    backward. Evaluation (no grad) records nothing."""

    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return output
        return _JoinBackward.apply(output, stats.after_forward())

    stage.register_forward_hook(hook)
