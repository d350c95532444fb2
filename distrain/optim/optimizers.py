"""A run's optimizers as one object, `Optimizers` (torchtitan's `OptimizersContainer`): one
optimizer per model part, and everything between a step's gradients and its update that belongs
to them: the learning-rate schedule, the fp16 loss scale every rank agrees on, what the
optimizers do to the gradients before clipping and the clip itself (the gradient plan they
declare, gradient_plan.py), the update, `zero_grad`, and their checkpoint state (a DCP
`Stateful` under the full model's parameter names, state_dict.py). The trainer's step asks this
object, never the optimizers one by one."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from distrain.config.schema import OptimConfig
from distrain.family.spec import ModelSpec
from distrain.optim.gradient_plan import GradientPlan, Named
from distrain.optim.schedule import lr_at, set_lr
from distrain.optim.state_dict import OptimizerState
from distrain.parallel.scaler import AgreedGradScaler


class Optimizers(Stateful):
    """The optimizers of the model parts (`per_part`, one each), stepped together."""

    def __init__(
        self,
        parts: list[nn.Module],
        per_part: list[torch.optim.Optimizer],
        *,
        plan: GradientPlan,
        scaler: AgreedGradScaler,
        spec: ModelSpec,
        cfg: OptimConfig,
        total_steps: int,
        counted_elsewhere: Collection[nn.Parameter] = (),
        logger: logging.Logger | None = None,
    ):
        """`counted_elsewhere`: parameters whose gradient another rank's copy already counts in
        the global norm (`ParallelModel.counted_elsewhere`)."""
        self.per_part, self.plan, self.scaler = per_part, plan, scaler
        self.cfg, self.total_steps = cfg, total_steps
        self.max_grad_norm = cfg.max_grad_norm or math.inf
        self.counted_elsewhere = counted_elsewhere
        self.log = logger or logging.getLogger(__name__)
        self._state = OptimizerState(parts, per_part, spec)
        self.fp16_skipped = 0
        """Steps the loss scaler skipped (gradients overflowed on some rank)."""

    # --- the step, in its order ---------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): the schedule's."""
        return lr_at(step, cfg=self.cfg, total_steps=self.total_steps)

    @property
    def fp16(self) -> bool:
        """Whether the loss is scaled (training.precision fp16): the scaler then decides which
        steps update."""
        return self.scaler.is_enabled()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (scaled under fp16)."""
        return self.scaler.scale(loss)

    def sync_in_backward(self) -> bool:
        """Whether backward averages the gradients over the data-parallel ranks this step."""
        return self.plan.sync_in_backward()

    def unscale_and_clip(self) -> torch.Tensor:
        """Unscale the gradients (fp16; every rank agrees on an overflow), let the optimizers
        act on them before clipping, clip to optim.max_grad_norm; the norm, a device tensor."""
        for optimizer in self.per_part:
            self.scaler.unscale_(optimizer)
        self.plan.before_clip()
        return self.plan.clip(self.max_grad_norm, counted_elsewhere=self.counted_elsewhere)

    def named_gradients(self) -> Iterator[Named]:
        """(name, holder of `.grad`) of every parameter, for the non-finite guard."""
        return self.plan.named_gradients()

    def norm_agreed(self) -> bool:
        """Whether every rank of the world holds the same gradient norm this step."""
        return self.plan.norm_agreed()

    def step(self, lr: float, *, update: bool, step: int) -> None:
        """Optimizer step `step` (1-based) at learning rate `lr` if `update` (the scaler may
        still skip it under fp16), the loss scale updated, the gradients dropped."""
        if update:
            for optimizer in self.per_part:
                set_lr(optimizer, lr)
                self.scaler.step(optimizer)
        self._update_scale(step)
        self.zero_grad()

    def zero_grad(self) -> None:
        for optimizer in self.per_part:
            optimizer.zero_grad(set_to_none=True)

    def _update_scale(self, step: int) -> None:
        """scaler.update(), noting a skipped step: the scale only drops when the (agreed)
        gradients overflowed. Reading the scale syncs the host, but scaler.step just did so
        reading the found-inf flag, so fp16 costs no extra wait."""
        if not self.fp16:
            self.scaler.update()
            return
        before = self.scaler.get_scale()
        self.scaler.update()
        after = self.scaler.get_scale()
        if after < before:
            self.fp16_skipped += 1
            self.log.warning(
                "step %d: fp16 gradients overflowed on some rank: step skipped by every rank, "
                "loss scale %g -> %g",
                step,
                before,
                after,
            )

    # --- checkpoint state ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)
