"""The one authority on devices, backends and process groups.

`ParallelDims` turns the `[parallel]` config and the world size into named axis degrees, checks
that they multiply to the world size, and builds the DeviceMesh. Only the data-parallel axis
exists so far; later axes (dp_shard, tp, pp) are added here and nowhere else. Nothing else in
distrain creates process groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.config import Config
from distrain.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its ranks, its device and the backend that serves it."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


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
    )


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product is the world size."""

    dp_replicate: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> ParallelDims:
        dp = cfg.parallel.dp_replicate
        if dp == -1:
            dp = world_size
        if dp <= 0 or dp != world_size:
            raise ConfigError(
                f"parallel.dp_replicate = {cfg.parallel.dp_replicate} does not fit a world size of "
                f"{world_size}; set it to {world_size} or -1"
            )
        dims = cls(dp_replicate=dp, world_size=world_size)
        dims.check_batch(cfg)
        return dims

    @property
    def dp_size(self) -> int:
        return self.dp_replicate

    def check_batch(self, cfg: Config) -> None:
        t = cfg.training
        if t.global_batch_size % (t.micro_batch_size * self.dp_size):
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel size "
                f"({self.dp_size}, from world size {self.world_size}); change the batch sizes or "
                "the number of processes"
            )

    def accum_steps(self, cfg: Config) -> int:
        return cfg.training.global_batch_size // (cfg.training.micro_batch_size * self.dp_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp_replicate,), mesh_dim_names=("dp_replicate",))
