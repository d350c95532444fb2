"""Out-of-memory recovery (`OutOfMemoryRecovery`, which wraps the step's forward and backward
under training.oom_recovery): a step that runs out of memory on any rank is retried by every
rank with half the micro-batch and twice the accumulation, so the global batch and the math stay
the same.

Ranks must agree before any gradient leaves a rank, or a rank that failed mid-backward would
leave the others waiting in a collective it never joins. So with recovery on, every micro-batch
runs without gradient sync, the ranks then agree on one flag (a max all-reduce), and only a step
that succeeded everywhere all-reduces its gradients.

Under FSDP2, tp, pp and cp the forward itself runs collectives (parameter all-gathers, tp
reductions, stage-to-stage sends, cp's key/value exchanges), so a rank cannot run on and report
afterwards. There the ranks agree before every micro-batch (`agreed`; under pp before the
schedule, which runs all micro-batches in one call) and once after the last, each micro-batch
synchronizes its own gradients, and on any failure every rank abandons the step, drops its
gradients and retries.
An OOM raised inside a micro-batch is recovered when every rank raises it at the same point
(ranks run the same shapes, so memory runs out alike) or at an agreement point; one that
strikes a single rank inside a micro-batch leaves the others waiting in a collective it never
joins, until comm.collective_timeout_s fails the run, as it would without recovery.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distrain.data.dataset import Batch
from distrain.errors import DistrainError
from distrain.observe.metrics import MetricsWriter
from distrain.parallel.device import DistContext
from distrain.parallel.model import ParallelModel
from distrain.train.fault_injection import FaultInjection

if TYPE_CHECKING:
    from distrain.data import DistributedBatchLoader


class OutOfMemoryAtMicroBatchOne(DistrainError):
    """Even one sequence per micro-batch does not fit."""


class StepAbandoned(Exception):
    """Every rank agreed to give up this step's attempt: some rank ran out of memory."""


def agreed(hook: Callable[[int], None], device: torch.device) -> Callable[[int], None]:
    """`hook` (the injected failure) followed by an agreement of every rank on whether any of
    them ran out of memory; raises StepAbandoned on every rank if one did. One flag all-reduce
    and host read per micro-batch (layouts with collectives in the forward; see module doc)."""

    def before_micro_batch(index: int) -> None:
        failed = False
        try:
            hook(index)
        except torch.OutOfMemoryError:
            failed = True
        if any_rank_failed(failed, device):
            raise StepAbandoned

    return before_micro_batch


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def any_rank_failed(failed: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def halve_micro_batch(current: int, *, step: int, logger: logging.Logger) -> int:
    if current == 1:
        raise OutOfMemoryAtMicroBatchOne(
            f"step {step} runs out of memory even with training.micro_batch_size = 1; use "
            "activation checkpointing, ZeRO (parallel.zero_stage), tp/pp, or a shorter seq_len"
        )
    smaller = current // 2
    logger.warning(
        "step %d ran out of memory on some rank: retrying with micro-batch %d (was %d), same "
        "global batch",
        step,
        smaller,
        current,
    )
    return smaller


def split(batches: list[Batch], micro_batch_size: int) -> list[Batch]:
    """The same samples, in the same order, cut into micro-batches of the new size (each part
    of a batch: inputs, targets and any document ids)."""
    parts = [torch.cat(part) for part in zip(*batches, strict=True)]
    return [
        tuple(part[i : i + micro_batch_size] for part in parts)
        for i in range(0, len(parts[0]), micro_batch_size)
    ]


class OutOfMemoryRecovery:
    """The step's forward and backward, retried with half the micro-batch (the loader's too,
    for the steps after) until it fits on every rank. Gradients are synchronized after the
    ranks agree, never by a rank that failed (see the module docstring)."""

    def __init__(
        self,
        model: ParallelModel,
        scale: Callable[[torch.Tensor], torch.Tensor],
        loader: DistributedBatchLoader,
        *,
        ctx: DistContext,
        grad_group: dist.ProcessGroup,
        bucket_cap_mb: float,
        faults: FaultInjection,
        metrics: MetricsWriter,
        logger: logging.Logger,
    ):
        self.model, self.scale, self.loader = model, scale, loader
        self.ctx, self.grad_group, self.bucket_cap_mb = ctx, grad_group, bucket_cap_mb
        self.faults, self.metrics, self.log = faults, metrics, logger
        dims = model.dims
        self.pipelined = dims.pp > 1
        # Collectives inside the forward (FSDP2, tp, pp, cp's key/value all-gather): the ranks
        # agree before each micro-batch.
        self.agree = dims.dp_wrapper == "fsdp" or self.pipelined or dims.cp > 1

    def forward_backward(
        self, batches: list[Batch], target_share: torch.Tensor, *, step: int
    ) -> torch.Tensor:
        """`ParallelModel.forward_backward` of optimizer step `step`'s micro-batches, the
        gradients synchronized, retried until it fits on every rank; the loss, reported (as
        with report_loss=True)."""
        while True:
            hook = self.faults.out_of_memory_hook(step, 1 if self.pipelined else len(batches))
            loss = self._attempt(batches, target_share, hook)
            if loss is not None:
                return loss
            self.model.zero_grad()
            free_memory(self.ctx.device)
            smaller = halve_micro_batch(self.loader.micro_batch_size, step=step, logger=self.log)
            self.loader.set_micro_batch_size(smaller)
            batches = split(batches, smaller)
            if self.pipelined:
                self.model.double_pipeline_microbatches()
            self.metrics.log({"step": step, "oom_retry_micro_batch_size": smaller})

    def _attempt(
        self,
        batches: list[Batch],
        target_share: torch.Tensor,
        hook: Callable[[int], None],
    ) -> torch.Tensor | None:
        """The loss of one attempt that succeeded on every rank, else None (every rank agrees)."""
        device = self.ctx.device
        if self.agree:
            # Every path below joins exactly one agreement per attempt after the last one it
            # passed, so the ranks' flag all-reduces pair up whoever failed where.
            try:
                loss = self.model.forward_backward(
                    batches,
                    self.scale,
                    sync_each=True,
                    before_micro_batch=agreed(hook, device),
                    target_share=target_share,
                )
                failed = False
            except StepAbandoned:
                return None  # agreed already, by every rank
            except torch.OutOfMemoryError:
                failed = True  # inside a micro-batch (see the module docstring on when)
            return None if any_rank_failed(failed, device) else loss
        try:
            loss = self.model.forward_backward(
                batches,
                self.scale,
                sync=False,
                before_micro_batch=hook,
                target_share=target_share,
            )
            failed = False
        except torch.OutOfMemoryError:
            failed = True
        if any_rank_failed(failed, device):
            return None
        self.model.all_reduce_gradients(self.grad_group, self.bucket_cap_mb)
        return loss
