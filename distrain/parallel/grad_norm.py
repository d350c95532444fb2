"""Global gradient norm and clipping over every shard and stage of any layout.

Each rank sums the squares of the gradient it holds locally, weighted so that a value stored on
several ranks (replicated across data-parallel ranks, or a Replicate placement of a DTensor)
counts once; one all-reduce over the world then gives the norm of the full model's gradient.
The same code runs on one process, so every layout clips with identical arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from distrain.parallel.local import local_tensor


def local_square_sum(grad: torch.Tensor, holders: int) -> torch.Tensor:
    """Sum of squares of this rank's share of `grad`, divided by how many ranks hold that share.

    `holders` is the number of ranks that have this parameter at all (a pipeline stage's ranks).
    """
    if isinstance(grad, DTensor):
        if any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(
                grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements]
            )
        # Any placement that is neither Replicate nor Partial splits the tensor (Shard, and the
        # _StridedShard FSDP2 uses on top of tp, whose is_shard() is False).
        distinct = math.prod(
            grad.device_mesh.size(i)
            for i, p in enumerate(grad.placements)
            if not (p.is_replicate() or p.is_partial())
        )
        local = grad.to_local()
    else:
        distinct, local = 1, grad
    return local.float().pow(2).sum() * (distinct / holders)


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    max_norm: float,
    *,
    holders: int,
    local: bool = False,
    counted_elsewhere: Collection[torch.nn.Parameter] = (),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip in place to `max_norm` (math.inf: measure only); returns the total norm (a tensor
    on the gradients' device, no host sync). `holders` = the ranks of `group` (None: the
    world) / pipeline degree; a DiLoCo site's gradient is normed over the site's `group`.
    local=True: the gradients were not synchronized (1-bit Adam's compressed phase), so each
    rank clips its own gradient by its own norm. `counted_elsewhere`: parameters clipped but
    left out of the norm, as another rank holds a copy of the same gradient (a tied embedding's
    head on the last pipeline stage)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    skipped = {id(p) for p in counted_elsewhere}
    for param in params:
        if param.grad is not None and id(param) not in skipped:
            total_sq += local_square_sum(param.grad, holders)
    if not local and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total_sq, group=group)
    total = total_sq.sqrt()
    if max_norm != math.inf:
        coef = clip_coefficient(total, max_norm)
        for grad in grads:
            local = local_tensor(grad)
            local.mul_(coef.to(local.dtype))
    return total


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to scale the gradients by for a global norm `total` (a device tensor)."""
    # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never up.
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # A non-finite norm would smear NaN over every gradient; leave them as they are so the
    # non-finite guard can name the parameter that holds it (the step is not taken).
    return torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
