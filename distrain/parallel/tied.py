"""A tied embedding split across pipeline stages: the token embedding lives on the first stage,
the output head on the last, and the two must stay one weight (the two parameters a family's
spec names in `tied_weights`).

As in Megatron-LM, each of the two ranks keeps its own copy. Both start from the same seeded
value (the family's `init_weights` names the head's copy after the embedding), and after every
backward the two gradients are summed over the group of the first and last pipeline rank
(`mesh.embedding_group`), which gives each copy the gradient of the shared weight: d loss /
d W = the embedding's part + the head's part. The optimizer then takes the same step on both
copies, so they stay equal without ever being sent. The head's copy is the one that the global
gradient norm leaves out (`counted_elsewhere`): the weight counts once, as in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.parallel.local import local_tensor


class TiedEmbedding:
    """This rank's copy of a tied embedding (if it holds the first or last stage) and the group
    it sums gradients over."""

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        group: dist.ProcessGroup,
        *,
        names: tuple[str, str],
    ):
        """`names`: the weight's parameter name on the first stage, then on the last."""
        self.group = group
        self.name = names[0]
        self.copy: nn.Parameter | None = None
        self.head_copy = False
        for part, stage in zip(parts, stage_ids, strict=True):
            if stage == 0:
                self.copy = part.get_parameter(names[0])
            elif stage == num_stages - 1:
                self.copy, self.head_copy = part.get_parameter(names[1]), True

    @property
    def counted_elsewhere(self) -> list[nn.Parameter]:
        """The head's copy: its gradient equals the embedding's once summed, so the global
        gradient norm must count only one of the two."""
        return [self.copy] if self.head_copy and self.copy is not None else []

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum the two copies' gradients (every rank of the group calls it after backward; a
        middle-stage rank holds no copy and is not in the group). Frozen copies (a LoRA run's
        base: both are) have none to sum."""
        if self.copy is None or not self.copy.requires_grad:
            return
        param, grad = self.copy, self.copy.grad
        if grad is None:
            grad = torch.zeros_like(param)
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            # Under tp the embedding's gradient comes full-size (Replicate, or Partial with
            # sequence parallel) while the head's is vocab-sharded like both weights: bring
            # both to the weight's layout so that the two ranks add the same slices.
            grad = grad.redistribute(placements=param.placements)
        dist.all_reduce(local_tensor(grad), group=self.group)
        param.grad = grad
