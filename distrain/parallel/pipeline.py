"""Pipeline parallelism: cutting a model into stages and running them with a torch schedule.

Which layers each stage holds and which stages each pp rank holds are stages.py's (arithmetic
that the planner reads without importing torch's pipelining); this module owns how a stage
module is cut from the meta-device model (`split_model`, by what the family's spec names as its
blocks and its first- and last-stage submodules). `PipelineRunner` then drives the stages of one
rank with `torch.distributed.pipelining`. Materializing, seeded init and data-parallel
wrapping of the stage modules stay with the caller (parallel/parallelize.py), in the usual order.

Stage placement is loop-style for every schedule: rank r holds stages r, r + pp, r + 2 pp, ...
"zero_bubble" is `ScheduleInterleavedZeroBubble` (ZB1P) rather than `ScheduleZBVZeroBubble`,
because it uses that same placement, so one placement rule, one last-stage rank (pp - 1) and any
`parallel.pp_stages_per_rank` >= 2 serve all four schedules; ZBV would need V placement and
exactly two stages per rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from distrain.errors import ConfigError
from distrain.family.spec import ModelSpec
from distrain.parallel.stages import stage_ids_for_rank, stage_layer_ranges

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

_SINGLE_STAGE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MULTI_STAGE_SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_model(model: nn.Module, stage_id: int, num_stages: int, *, spec: ModelSpec) -> nn.Module:
    """The stage module `stage_id` of `num_stages`, cut from `model` (meant to be on meta), a
    model of the family `spec`.

    A pruned deep copy rather than a new class: the stage keeps the blocks of its layer range
    under their original keys (`spec.blocks`) and the family's attribute names, with the
    submodules of other stages (`spec.first_stage`, `spec.last_stage`) set to None, so parameter
    names (and so init values and checkpoint keys) equal the full model's; the family's forward
    treats a missing embedding or head as a cut.
    """
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id {stage_id} is outside 0..{num_stages - 1}")
    layers = stage_layer_ranges(len(getattr(model, spec.blocks)), num_stages)[stage_id]
    stage = copy.deepcopy(model)
    blocks = getattr(stage, spec.blocks)
    for key in list(blocks.keys()):
        if int(key) not in layers:
            del blocks[key]
    if stage_id != 0:
        for name in spec.first_stage:
            setattr(stage, name, None)
    if stage_id != num_stages - 1:
        for name in spec.last_stage:
            setattr(stage, name, None)
    return stage


class PipelineRunner:
    """Runs this rank's pipeline stages through one torch schedule.

    Built after the stage modules are materialized, initialized and (optionally) wrapped, so it
    takes them as given. A step's loss is the sum of the microbatches' `loss_fn` values divided
    by a `loss_divisor`: n_microbatches by default (their mean), the step's target share for a
    loss summed over targets (see parallel/model.py), so that microbatches holding unequally
    many targets weigh by their targets. The schedule's microbatch loss is loss_fn x
    n_microbatches / loss_divisor, and torch's `scale_grads` divides the summed microbatch
    gradients by n_microbatches. Document ids reach every stage as a keyword argument of the
    schedule's step, which torch splits into microbatches like the inputs and passes to each
    stage's forward, so no stage needs them from its neighbour.

    `stage_modules`/`stage_ids` stay readable for the optimizer and checkpointing;
    `has_first_stage`/`has_last_stage` say whether this rank feeds tokens and gets the loss.
    """

    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        pp_mesh: DeviceMesh,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        loss_fn: LossFn,
    ):
        pp_size = pp_mesh.size()
        expected = stage_ids_for_rank(pp_mesh.get_local_rank(), pp_size, len(stage_ids), schedule)
        if stage_ids != expected or len(stage_modules) != len(stage_ids):
            raise ValueError(
                f"pp rank {pp_mesh.get_local_rank()} must hold stages {expected} (one module "
                f"each) under {schedule!r}; got stages {stage_ids} and {len(stage_modules)} modules"
            )
        if num_stages != pp_size * len(stage_ids):
            raise ValueError(
                f"{num_stages} stages do not fill {pp_size} pp ranks x {len(stage_ids)} stages"
            )
        if n_microbatches < 1:
            raise ConfigError(f"parallel.pp_microbatches = {n_microbatches} must be at least 1")
        self.stage_modules = stage_modules
        self.stage_ids = stage_ids
        self.n_microbatches = n_microbatches
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        self._group = pp_mesh.get_group()
        self._last_stage_rank = dist.get_global_rank(self._group, (num_stages - 1) % pp_size)
        self._device = device
        self._batch_shape: torch.Size | None = None
        self._loss_fn = loss_fn
        # fp16 loss scaling: the schedule backpropagates the scaled loss; the unscaled
        # microbatch losses are kept for reporting (see `_scaled_loss`).
        self._scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._unscaled: list[torch.Tensor] = []
        # n_microbatches / loss_divisor of the step being run (see the class docstring).
        self._weight: torch.Tensor | float = 1.0
        stages = [
            PipelineStage(module, stage_id, num_stages, device, group=self._group)
            for module, stage_id in zip(stage_modules, stage_ids, strict=True)
        ]
        try:
            if schedule in _SINGLE_STAGE_SCHEDULES:
                self._schedule = _SINGLE_STAGE_SCHEDULES[schedule](
                    stages[0], n_microbatches, loss_fn=self._scaled_loss, scale_grads=True
                )
            else:
                self._schedule = _MULTI_STAGE_SCHEDULES[schedule](
                    stages, n_microbatches, loss_fn=self._scaled_loss, scale_grads=True
                )
        except ValueError as err:
            # torch's own constraint on the microbatch count for this schedule and stage count.
            raise ConfigError(
                f"parallel.pp_microbatches = {n_microbatches} does not suit "
                f"parallel.pp_schedule = {schedule!r} with {num_stages} stages: {err}"
            ) from err

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(output, target) * self._weight
        if self._scale is None:
            return loss
        self._unscaled.append(loss.detach())
        return self._scale(loss)

    def _check_batch(self, inputs: torch.Tensor) -> None:
        """Stages size their receive buffers from the first batch they see, so a later batch of
        another shape would be received into the wrong buffers: refuse it instead."""
        if self._batch_shape is None:
            if inputs.shape[0] % self.n_microbatches:
                raise ConfigError(
                    f"a local batch of {inputs.shape[0]} sequences does not split into "
                    f"parallel.pp_microbatches = {self.n_microbatches} equal microbatches; make "
                    "the micro batch size a multiple of it"
                )
            self._batch_shape = inputs.shape
        elif inputs.shape != self._batch_shape:
            raise ValueError(
                f"pipeline batches must keep the first batch's shape {list(self._batch_shape)}, "
                f"got {list(inputs.shape)}; pad or drop the odd batch"
            )

    def _run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        train: bool,
        loss_divisor: torch.Tensor | float | None,
        documents: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One pass over all microbatches; the step's loss (the class docstring) on the
        last-stage rank.

        Every rank passes the targets (cheap to split) and any document ids (every stage's
        attention reads them) but only a first-stage rank passes the inputs: the others receive
        activations. Outputs are not merged (`return_outputs=False`): the last stage would
        otherwise keep every microbatch's logits alive for the whole step.
        """
        self._check_batch(inputs)
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {} if documents is None else {"documents": documents}
        losses: list[torch.Tensor] = []
        run = self._schedule.step if train else self._schedule.eval
        self._unscaled = []
        if loss_divisor is not None:
            self._weight = self.n_microbatches / loss_divisor
        try:
            run(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._weight = 1.0
        if not self.has_last_stage:
            return None
        # The first step's shape inference calls the loss function once more, on placeholder
        # data, before the microbatches: their losses are the last n_microbatches recorded.
        unscaled = self._unscaled[-self.n_microbatches :]
        return torch.stack(unscaled or losses).detach().float().mean()

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        loss_divisor: torch.Tensor | float | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward over the local batch [B, T]; grads accumulate into .grad, those
        of the step's loss (the sum of the microbatch losses / `loss_divisor`, default their
        mean). `scale` (fp16 loss scaling) multiplies each microbatch loss before its backward;
        `documents` [B, T]: the sequences' document ids.

        Returns the step's loss (detached fp32 scalar) on the rank holding the last stage, else
        None.
        """
        self._scale = scale
        try:
            return self._run(
                inputs, targets, train=True, loss_divisor=loss_divisor, documents=documents
            )
        finally:
            self._scale = None

    @torch.no_grad()
    def eval_loss(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        loss_divisor: float | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Forward only; the loss (as `train_step` has it) on the last-stage rank, else None.
        Same batch shape as training (see `_check_batch`)."""
        return self._run(
            inputs, targets, train=False, loss_divisor=loss_divisor, documents=documents
        )

    def broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every pp rank, for logging (a collective over the pp group:
        call it on every pp rank, and only at the logging interval, as it syncs the ranks)."""
        value = loss if loss is not None else torch.zeros((), device=self._device)
        value = value.detach().float().clone()
        dist.broadcast(value, src=self._last_stage_rank, group=self._group)
        return value
