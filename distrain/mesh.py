"""The one authority on devices, backends and the training process groups.

`ParallelDims` turns the `[parallel]` config and the world size into named axis degrees (pp,
dp_replicate, dp_shard, tp), checks that they multiply to the world size, and builds the
DeviceMesh; `node_groups` makes the groups of the hierarchical all-reduce. New axes and the
groups the training step communicates over are added here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.config import Config
from distrain.errors import ConfigError
from distrain.torch_compat import flatten_mesh


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its ranks, its device and the backend that serves it."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    local_world_size: int = 1


def pick_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """Device and backend in one place: CUDA with NCCL when present, else CPU with gloo."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device = 'cuda' but CUDA is not available; use auto or cpu")
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(requested_device: str) -> DistContext:
    """Join the process group torchrun set up in the environment, or form a 1-process group."""
    env_rank = os.environ.get("RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if env_rank is not None:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=device,
        backend=backend,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
    )


AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product is the world size.

    Mesh axes, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallelism is innermost so
    its chatty collectives stay on the fastest links (one node); pipeline is outermost since it
    sends the least. `dp` (dp_replicate x dp_shard) is the data-parallel group the loader splits
    the global batch over.
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero_stage: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> ParallelDims:
        p = cfg.parallel
        for name in ("tp", "pp"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
        if world_size % (p.tp * p.pp):
            raise ConfigError(
                f"parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = {p.tp * p.pp} does not divide the "
                f"world size {world_size}; choose degrees whose product divides it"
            )
        dp = world_size // (p.tp * p.pp)
        replicate, shard = p.dp_replicate, p.dp_shard
        if p.zero_stage <= 1:
            if shard not in (-1, 1):
                raise ConfigError(
                    f"parallel.dp_shard = {shard} needs parallel.zero_stage 2 or 3 (FSDP2); "
                    "with zero_stage 0/1 data parallelism is replication: set dp_shard = 1"
                )
            shard = 1
            replicate = dp if replicate == -1 else replicate
        elif shard == -1:
            replicate = 1 if replicate == -1 else replicate
            if replicate < 1 or dp % replicate:
                raise ConfigError(
                    f"parallel.dp_replicate ({replicate}) must divide the data-parallel size {dp} "
                    f"(world {world_size} / tp {p.tp} / pp {p.pp})"
                )
            shard = dp // replicate
        elif replicate == -1:
            if shard < 1 or dp % shard:
                raise ConfigError(
                    f"parallel.dp_shard ({shard}) must divide the data-parallel size {dp} "
                    f"(world {world_size} / tp {p.tp} / pp {p.pp})"
                )
            replicate = dp // shard
        if replicate * shard != dp or replicate < 1 or shard < 1:
            raise ConfigError(
                f"parallel.dp_replicate ({p.dp_replicate}) x dp_shard ({p.dp_shard}) x tp ({p.tp}) "
                f"x pp ({p.pp}) must equal the world size {world_size}; set one of them to -1"
            )
        dims = cls(
            pp=p.pp,
            dp_replicate=replicate,
            dp_shard=shard,
            tp=p.tp,
            zero_stage=p.zero_stage,
            world_size=world_size,
        )
        dims.check_batch(cfg)
        return dims

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_wrapper(self) -> str:
        """How the model is wrapped for data parallelism: "none" when there is one replica,
        "fsdp" (FSDP2) for ZeRO 2/3 and also for plain replication whenever tp or pp is on (HSDP
        with a shard axis of 1, since DDP handles neither DTensor parameters nor pipeline stages
        correctly), else "ddp"."""
        if self.dp_size == 1:
            return "none"
        if self.zero_stage >= 2 or self.tp > 1 or self.pp > 1:
            return "fsdp"
        return "ddp"

    def check_batch(self, cfg: Config) -> None:
        t = cfg.training
        if t.global_batch_size % (t.micro_batch_size * self.dp_size):
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel size "
                f"({self.dp_size}, from world size {self.world_size}); change the batch sizes or "
                "the number of processes"
            )

    def describe(self) -> str:
        return (
            f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} "
            f"zero_stage={self.zero_stage}"
        )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The world mesh with every axis (size-1 axes included, so names never go missing), and
        the 1-D data-parallel mesh (dp_replicate x dp_shard flattened) the loader splits over."""
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=AXES,
        )
        return mesh, flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")


def node_groups(
    local_world_size: int, dp_ranks: list[int]
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """Groups for a topology-aware all-reduce over the data-parallel ranks `dp_ranks`: this
    rank's node (ranks sharing rank // local_world_size) and, on each node's first rank, the
    group of those first ranks. Every rank creates every group, in the same order, as
    `new_group` requires."""
    by_node: dict[int, list[int]] = {}
    for r in dp_ranks:
        by_node.setdefault(r // local_world_size, []).append(r)
    me = dist.get_rank()
    intra = None
    for members in by_node.values():
        group = dist.new_group(members)
        if me in members:
            intra = group
    leaders = [members[0] for members in by_node.values()]
    inter = dist.new_group(leaders)
    return intra, inter if me in leaders else None
