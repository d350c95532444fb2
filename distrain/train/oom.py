"""Out-of-memory recovery: a step that runs out of memory on any rank is retried by every rank
with half the micro-batch and twice the accumulation, so the global batch and the math stay the
same.

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

import torch
import torch.distributed as dist

from distrain.errors import DistrainError


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


def split(batches: list[tuple[torch.Tensor, ...]], micro_batch_size: int):
    """The same samples, in the same order, cut into micro-batches of the new size (each part
    of a batch: inputs, targets and any document ids)."""
    parts = [torch.cat(part) for part in zip(*batches, strict=True)]
    return [
        tuple(part[i : i + micro_batch_size] for part in parts)
        for i in range(0, len(parts[0]), micro_batch_size)
    ]
