"""Data parallelism: DDP (ZeRO 0/1) over the flattened `dp` axis, or FSDP2 (ZeRO 2/3, HSDP, and
replication under tp/pp) over the dp_replicate x dp_shard axes.

DDP is built in three steps (`apply_ddp`, `settle_bucket_layout`, `install_comm_hook`) so that
its gradient buckets are final before the first real step and a communication hook sees only
real steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from distrain.config.schema import CommConfig
from distrain.parallel.compress import (
    CommStats,
    HierarchicalState,
    build_comm_hook,
    hierarchical_allreduce_hook,
)
from distrain.parallel.experts import expert_modules
from distrain.parallel.mesh import ParallelDims, node_groups
from distrain.torch_compat import ddp_without_forward_buffer_sync


def apply_ddp(
    model: nn.Module, dp_mesh: DeviceMesh, *, bucket_cap_mb: float, device: torch.device
) -> DistributedDataParallel:
    """Wrap `model` (already materialized and initialized identically on every rank) in DDP.

    Gradients are views into DDP's buckets (`gradient_as_bucket_view`): no copy from the bucket
    back to `.grad` after the all-reduce, and no second gradient-sized buffer. DDP broadcasts
    rank 0's parameters at construction; since init is seeded and rank-independent that
    broadcast changes nothing, but it guards against any rank-dependent init sneaking in.
    """
    return DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        # Buffers (the rotary table, an MoE router's bias) are equal on every rank: broadcasting
        # them before each forward would be a collective per step for nothing (the keyword
        # differs between torch releases: torch_compat).
        **ddp_without_forward_buffer_sync(),
    )


def settle_bucket_layout(ddp: DistributedDataParallel, iteration: Callable[[], None]) -> None:
    """Run one throwaway forward/backward so that DDP's buckets are final before training.

    DDP's first iteration all-reduces with a provisional bucket layout (one bucket in torch
    2.13), records the order in which gradients become ready, and rebuilds its buckets in that
    order at the next forward, once. A process that restarts from a checkpoint would run its
    first step on the provisional layout while an uninterrupted run is on the rebuilt one, and
    with 3 or more ranks the all-reduce then adds each element's terms in another order (a+b+c
    is not (a+c)+b in fp32): the resumed run drifts by an ulp from its first step. After this
    iteration every run, fresh or resumed, trains on the rebuilt layout from its first step.
    The iteration's gradients are discarded; it costs one micro-batch's forward and backward
    and one fp32 all-reduce of the gradients at startup. `iteration` must run one synchronized
    forward and backward through `ddp` and leave the gradients set.
    """
    iteration()
    for p in ddp.parameters():
        p.grad = None


def install_comm_hook(
    ddp: DistributedDataParallel,
    dp_mesh: DeviceMesh,
    *,
    comm: CommConfig,
    stats: CommStats,
    local_world_size: int,
    timeout_s: float = 0.0,
) -> bool:
    """Register the configured communication hook, which counts the bytes it issues into
    `stats`. Returns False, registering nothing, for plain fp32 all-reduce: DDP's built-in C++
    path then runs with no Python on it, and the caller counts `allreduce_payload(ddp)` per
    synchronized step instead. `timeout_s`: the hierarchical groups' collective timeout."""
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
        return True
    if comm.gradient_compression == "none":
        return False
    ddp.register_comm_hook(
        *build_comm_hook(
            comm.gradient_compression,
            process_group=dp_mesh.get_group(),
            stats=stats,
            powersgd_rank=comm.powersgd_rank,
            powersgd_start_iter=comm.powersgd_start_step,
        )
    )
    return True


def allreduce_payload(ddp: DistributedDataParallel) -> tuple[int, int]:
    """(elements, bytes) DDP's own all-reduce issues per synchronized backward: its buckets
    hold every gradient-carrying parameter once, in the parameter's dtype, unpadded."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    precision: str,
    blocks: nn.ModuleDict,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """fully_shard every one of `blocks` (the model's repeated blocks), then the root (the rest:
    embedding, norm, head), on the data-parallel mesh.

    ZeRO-3 reshards parameters after forward (gathered again in backward); below stage 3 they stay
    gathered between forward and backward, so only gradients and optimizer state are sharded.
    Pipeline stages never reshard after forward: a schedule runs every micro-batch's forward
    before (or between) the backwards, so resharding would all-gather the stage's parameters
    again for each micro-batch (torchtitan keeps them gathered for pp the same way).

    Under expert parallelism (`expert_mesh`: the dp_mod_ep axis) each block's experts are
    sharded first, on their own: their weights are already split over ep, and FSDP shards them
    over the data-parallel ranks ep does not use, averaging their gradients there (experts.py
    has averaged them over ep).
    """
    dp_mesh = dims.fsdp_mesh(mesh)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = dims.zero_stage == 3 and dims.pp == 1
    for block in blocks.values():
        if expert_mesh is not None:
            for experts in expert_modules(block):
                fully_shard(
                    experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy
                )
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model
