"""What happens to the gradients between backward and the optimizer step, as the optimizers'
capability (capability.py) has it at run time: whether backward averages them (DDP, FSDP2),
what the optimizers do before clipping, how the norm is taken and where the non-finite guard
reads them. `build_optimizers` builds the plan with the optimizers, and `Optimizers`
(optimizers.py) asks it in every step."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain.optim.onebit_adam import OneBitAdam
from distrain.optim.onebit_zero import OneBitZeroAdam
from distrain.parallel.grad_norm import clip_grad_norm

Named = tuple[str, Any]


class GradientPlan:
    """The wrapper (DDP, FSDP2; or one replica) averages the gradients in backward, and the
    global norm over every shard and stage clips them (AdamW, plain or ZeRO-1)."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        holders: int,
        norm_group: dist.ProcessGroup | None = None,
    ):
        self.parts = parts
        self.holders = holders
        """Ranks that hold a parameter: those of `norm_group` over the pipeline degree."""
        self.norm_group = norm_group
        """The ranks whose gradient the norm is taken of: None, the world; a DiLoCo site's
        group, whose gradient is its own (`ParallelDims.diloco`)."""

    def sync_in_backward(self) -> bool:
        """Whether backward averages the gradients over the data-parallel ranks this step."""
        return True

    def norm_agreed(self) -> bool:
        """Whether every rank of the world holds the same gradient norm this step."""
        return self.sync_in_backward() and self.norm_group is None

    def before_clip(self) -> None:
        """What the optimizers do to the (unscaled) gradients before they are clipped."""

    def clip(self, max_norm: float, *, counted_elsewhere: Collection[nn.Parameter]) -> torch.Tensor:
        """Clip to `max_norm` (math.inf: measure only); the norm, a device tensor. Gradients
        kept local in backward are clipped by each rank's own norm."""
        local = not self.sync_in_backward()
        return clip_grad_norm(
            [p for part in self.parts for p in part.parameters()],
            max_norm,
            holders=1 if local else self.holders,
            local=local,
            counted_elsewhere=counted_elsewhere,
            group=self.norm_group,
        )

    def named_gradients(self) -> Iterator[Named]:
        """(name, holder of `.grad`) of every parameter, for the non-finite guard (read lazily,
        when it stops)."""
        for part in self.parts:
            yield from part.named_parameters()


class OneBitAdamPlan(GradientPlan):
    """1-bit Adam: past warm-up each rank keeps its gradients local (the momentum crosses the
    network); without a wrapper (tp, pp) it averages the warm-up's gradients itself."""

    def __init__(self, parts: list[nn.Module], optimizers: list[OneBitAdam], *, holders: int):
        super().__init__(parts, holders=holders)
        self.optimizers = optimizers

    def sync_in_backward(self) -> bool:
        return not any(o.keeps_gradients_local() for o in self.optimizers)

    def before_clip(self) -> None:
        for optimizer in self.optimizers:
            if optimizer.averages_gradients:
                optimizer.average_gradients()


class OneBitZeroPlan(GradientPlan):
    """1-bit Adam under ZeRO-1/2 (one model part: no pp): gradients local past warm-up; under
    ZeRO-2 (`shards_gradients`) the optimizer reduce-scatters them to their owners and clips
    through that reduce, and the guard reads the chunk of the averaged gradient it owns."""

    def __init__(self, parts: list[nn.Module], optimizer: OneBitZeroAdam, *, holders: int):
        super().__init__(parts, holders=holders)
        self.optimizer = optimizer

    def sync_in_backward(self) -> bool:
        return not self.optimizer.keeps_gradients_local()

    def clip(self, max_norm: float, *, counted_elsewhere: Collection[nn.Parameter]) -> torch.Tensor:
        if self.optimizer.shards_gradients:
            return self.optimizer.reduce_and_clip(max_norm)
        return super().clip(max_norm, counted_elsewhere=counted_elsewhere)

    def named_gradients(self) -> Iterator[Named]:
        """Under ZeRO-2 in warm-up, whose local gradients `reduce_and_clip` freed, (name,
        holder) whose `.grad` is this rank's part of that parameter's averaged gradient (None
        where it holds none): a NaN shows on the rank that owns its chunk."""
        owned = self.optimizer.owned_gradients()
        if not owned:
            yield from super().named_gradients()
            return
        for part in self.parts:
            for name, p in part.named_parameters():
                yield name, SimpleNamespace(grad=owned.get(id(p)))
