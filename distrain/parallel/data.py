"""Data parallelism: DDP (ZeRO 0/1) over the flattened `dp` axis, or FSDP2 (ZeRO 2/3, HSDP, and
replication under tp/pp) over the dp_replicate x dp_shard axes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from distrain.config import CommConfig
from distrain.mesh import ParallelDims, node_groups
from distrain.models.gpt import GPT
from distrain.parallel.compress import (
    CommStats,
    HierarchicalState,
    build_comm_hook,
    hierarchical_allreduce_hook,
)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    comm: CommConfig,
    stats: CommStats,
    local_world_size: int,
    device: torch.device,
    timeout_s: float = 0.0,
) -> DistributedDataParallel:
    """Wrap `model` (already materialized and initialized identically on every rank) in DDP with
    the configured gradient communication hook, which also counts the bytes it issues.

    DDP broadcasts rank 0's parameters at construction; since init is seeded and rank-independent
    that broadcast changes nothing, but it guards against any rank-dependent init sneaking in.
    """
    ddp = DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=comm.bucket_cap_mb,
    )
    if comm.hierarchical:
        intra, inter = node_groups(
            local_world_size,
            dist.get_process_group_ranks(dp_mesh.get_group()),
            timeout_s=timeout_s,
        )
        state = HierarchicalState(
            intra_group=intra,
            inter_group=inter,
            leader_global_rank=min(dist.get_process_group_ranks(intra)),
            world_size=dp_mesh.size(),
            stats=stats,
        )
        ddp.register_comm_hook(state, hierarchical_allreduce_hook)
    else:
        ddp.register_comm_hook(
            *build_comm_hook(
                comm.gradient_compression,
                process_group=dp_mesh.get_group(),
                stats=stats,
                powersgd_rank=comm.powersgd_rank,
                powersgd_start_iter=comm.powersgd_start_step,
            )
        )
    return ddp


def apply_fsdp(model: GPT, mesh: DeviceMesh, dims: ParallelDims, *, precision: str) -> GPT:
    """fully_shard every block, then the root (embedding, norm, head), on the data-parallel mesh.

    ZeRO-3 reshards parameters after forward (gathered again in backward); below stage 3 they stay
    gathered between forward and backward, so only gradients and optimizer state are sharded.
    """
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = dims.zero_stage == 3
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model
