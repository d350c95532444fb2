"""DiLoCo's outer step (Douillard et al. 2023): every diloco.inner_steps inner steps, and after
the last step, the sites (the parallel.dp_replicate groups) average their pseudo-gradients
(global weights minus local weights) and an SGD step with (Nesterov) momentum updates the
global weights, which every site then continues from.

Each rank works on the shards it holds: a site's ranks hold its parameters as FSDP2 (and tp)
shards, and the rank of another site with the same pp, dp_shard, cp and tp coordinates holds
the same shards, so the pseudo-gradients are averaged over the dp_replicate axis shard by
shard, in flat buckets, in fp32 or bf16 (diloco.sync_dtype). The global weights and the
momentum are fp32 copies of those shards on the parameters' device.

torchft (PyPI, 0.2.0) has DiLoCo and Streaming DiLoCo, but both run under its `Manager`, which
needs a lighthouse server for quorum, its own reconfigurable process group and its commit
protocol, and keeps the outer state with that manager; here the sites are groups of the run's
own device mesh and the outer state is part of the run's checkpoints (train/state.py).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.config.schema import DiLoCoConfig
from distrain.parallel.compress import wire_bytes
from distrain.parallel.grad_norm import local_square_sum
from distrain.parallel.local import copy_from_flat, local_tensor

_SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class DiLoCo:
    """The outer optimizer of this rank's shards of `parts`: `after_step` runs the outer step
    when one is due. Collective over the world at each outer step (the metrics' all-reduce)."""

    def __init__(
        self,
        parts: list[nn.Module],
        cfg: DiLoCoConfig,
        *,
        sites: dist.ProcessGroup,
        site: int,
        total_steps: int,
        holders: int,
        bucket_cap_mb: float,
        counted_elsewhere: Collection[nn.Parameter] = (),
    ):
        """`sites`: this rank's group over the dp_replicate axis (one rank per site); `site`:
        this rank's site index. `holders`: the ranks that hold a parameter (world size over
        the pipeline degree), for the metrics' norms; `counted_elsewhere`: parameters another
        rank's copy counts there (a tied head on the last pipeline stage)."""
        self.cfg = cfg
        self.sites, self.site = sites, site
        self.num_sites = dist.get_world_size(sites)
        self.total_steps = total_steps
        self.holders = holders
        self.bucket_elements = max(1, int(bucket_cap_mb * 2**20) // 4)
        self.params = [(name, p) for part in parts for name, p in part.named_parameters()]
        skipped = {id(p) for p in counted_elsewhere}
        self.counted = [id(p) not in skipped for _, p in self.params]
        with torch.no_grad():
            self.global_weights = [local_tensor(p).detach().float().clone() for _, p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.global_weights]
        self.outer_steps = 0
        self.bytes_sent = 0.0
        """Bytes this rank sent for outer steps since `take_bytes` last read them."""
        self.pseudo_grad_norm: torch.Tensor | None = None
        """The norm of the averaged pseudo-gradient at the last outer step (a device tensor),
        until `take_last_step` reads it."""
        self.drift: torch.Tensor | None = None
        """At the last outer step, the root mean square over sites of the distance between a
        site's pseudo-gradient and their average (0 when every site moved alike), until
        `take_last_step` reads it."""

    def due(self, step: int) -> bool:
        return step % self.cfg.inner_steps == 0 or step == self.total_steps

    def after_step(self, step: int) -> None:
        """Inner step `step` (1-based) is done: run the outer step if it is due."""
        if self.due(step):
            self.outer_step()

    def take_bytes(self) -> float:
        """The bytes sent since the last call, and start counting again."""
        sent, self.bytes_sent = self.bytes_sent, 0.0
        return sent

    def take_last_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(pseudo-gradient norm, drift) of the last outer step if one ran since the last call,
        else None."""
        if self.pseudo_grad_norm is None or self.drift is None:
            return None
        taken = (self.pseudo_grad_norm, self.drift)
        self.pseudo_grad_norm = self.drift = None
        return taken

    @torch.no_grad()
    def outer_step(self) -> None:
        locals_ = [local_tensor(p) for _, p in self.params]
        deltas = torch._foreach_sub(self.global_weights, [t.float() for t in locals_])
        own_sq = self._square_sum(deltas)
        self._average(deltas)
        squares = torch.stack([own_sq, self._square_sum(deltas)])
        if dist.get_world_size() > 1:
            dist.all_reduce(squares)
        # Mean over sites of |d_s|^2 minus |mean d|^2 = mean over sites of |d_s - mean d|^2.
        self.drift = (squares[0] - squares[1]).clamp(min=0).sqrt()
        self.pseudo_grad_norm = squares[1].sqrt()
        c = self.cfg
        update = deltas
        if c.outer_momentum > 0:
            torch._foreach_mul_(self.momentum, c.outer_momentum)
            torch._foreach_add_(self.momentum, deltas)
            update = (
                torch._foreach_add(deltas, self.momentum, alpha=c.outer_momentum)
                if c.nesterov
                else self.momentum
            )
        torch._foreach_add_(self.global_weights, update, alpha=-c.outer_lr)
        for local, weights in zip(locals_, self.global_weights, strict=True):
            local.copy_(weights)
        self.outer_steps += 1

    def _average(self, deltas: list[torch.Tensor]) -> None:
        """Average `deltas` over the sites in place, in flat buckets of the sync dtype."""
        dtype = _SYNC_DTYPES[self.cfg.sync_dtype]
        bucket: list[torch.Tensor] = []
        size = 0
        for i, delta in enumerate(deltas):
            bucket.append(delta)
            size += delta.numel()
            if size >= self.bucket_elements or i == len(deltas) - 1:
                flat = torch.cat([d.reshape(-1) for d in bucket]).to(dtype)
                dist.all_reduce(flat, group=self.sites)
                self.bytes_sent += wire_bytes("all_reduce", flat.nbytes, self.num_sites)
                copy_from_flat(flat.float() / self.num_sites, bucket)
                bucket, size = [], 0

    def _square_sum(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's weighted share of the mean over sites of |tensors|^2 (parameter-shaped
        shards; summed over the world it is that mean, as parallel/grad_norm.py counts)."""
        total = torch.zeros((), device=tensors[0].device if tensors else "cpu")
        for (_, p), t, counted in zip(self.params, tensors, self.counted, strict=True):
            if counted:
                total += local_square_sum(self.like(p, t), self.holders)
        return total

    @staticmethod
    def like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """`local`, this rank's shard of a tensor shaped and placed as `param` (a DTensor of the
        same mesh and placements, sharing `local`'s storage), or `local` for a plain tensor."""
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def named(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (one per parameter, this rank's shard) under the parameters' names, each
        placed as its parameter: the entries of a checkpoint that any layout loads."""
        return {name: self.like(p, t) for (name, p), t in zip(self.params, tensors, strict=True)}

    def load_named(self, tensors: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (as `named` gives it, loaded) into `tensors`."""
        with torch.no_grad():
            for (name, _), t in zip(self.params, tensors, strict=True):
                loaded = local_tensor(state[name])
                if loaded.data_ptr() != t.data_ptr():
                    t.copy_(loaded)
