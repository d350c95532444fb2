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
        # Not a view (view_as): a zero-bubble schedule detaches the stage output in place
        # after its input backward, which autograd refuses for a view.
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.term_shape, device=grad.device)


def join_balancing_losses(stages: list[nn.Module], stats: MoEStats) -> None:
    """Hook each of this rank's `stages` that holds MoE layers so that each of its training
    forwards records the statistics of its own layers and their balancing term joins the
    backward of that stage's micro-batch (several stages per rank run their micro-batches
    interleaved, so each hands on only what it computed). Evaluation (no grad) records
    nothing."""

    def hook(module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return output
        return _JoinBackward.apply(output, stats.after_forward(module))

    for stage in stages:
        if stats.moe_layers(stage):
            stage.register_forward_hook(hook)
