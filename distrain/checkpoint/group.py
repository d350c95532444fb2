"""The collectives of the checkpoint protocol (`CheckpointGroup`): rank 0's value on every
rank, and every rank's value in rank order, over the checkpoint's own process group
(parallel/device.py's `checkpoint_group`: gloo, apart from training's collectives), or this
process alone outside a distributed run."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from distrain.parallel.device import checkpoint_group


class CheckpointGroup:
    def __init__(self, collective_timeout_s: float):
        initialized = dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.group = checkpoint_group(collective_timeout_s)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out
