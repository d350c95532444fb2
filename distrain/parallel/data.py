"""Data parallelism: DDP over the mesh's data-parallel axis, with configurable gradient buckets."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(
    model: nn.Module, dp_mesh: DeviceMesh, *, bucket_cap_mb: float, device: torch.device
) -> DistributedDataParallel:
    """Wrap `model` (already materialized and initialized identically on every rank) in DDP.

    DDP broadcasts rank 0's parameters at construction; since init is seeded and rank-independent
    that broadcast changes nothing, but it guards against any rank-dependent init sneaking in.
    """
    return DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )
