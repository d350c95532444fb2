"""DiLoCo's outer step (Douillard et al. 2023): every diloco.inner_steps inner steps, and after
the last step, the sites (the parallel.dp_replicate groups) average their pseudo-gradients
(global weights minus local weights) and an SGD step with (Nesterov) momentum updates the
global weights, which every site then continues from.

Streaming DiLoCo (Douillard et al. 2025; diloco.fragments F > 1): the parameters split into F
fragments of about equal size in model order, and fragment f's outer step runs at the steps
where (step - f * H // F) % H == 0, so one outer step sends 1/F of the pseudo-gradients. With
diloco.overlap_steps tau > 0 a fragment's average is issued asynchronously and its outer step
runs tau inner steps later, after waiting on the collective's handle (on NCCL, `wait` orders
the current stream after the collective: its result is read only after that); the fragment's
weights then become overlap_mix x the site's weights (trained on meanwhile) + (1 -
overlap_mix) x the new global weights. After the last step every fragment takes an outer
step, so every site ends on the global weights.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.config.schema import DiLoCoConfig
from distrain.optim.diloco_resume import SITES_SYNCED
from distrain.parallel.compress import wire_bytes
from distrain.parallel.grad_norm import local_square_sum
from distrain.parallel.local import copy_from_flat, local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from distrain.parallel.mesh import ParallelDims
    from distrain.parallel.model import ParallelModel

_SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class _InFlight:
    """A fragment's pseudo-gradients on their way to the sites' average."""

    fragment: int
    merge_step: int
    """The inner step after which the outer step runs."""
    deltas: list[torch.Tensor]
    """The fragment's pseudo-gradients; the average once `averaged`."""
    own_square: torch.Tensor
    """This rank's share of the mean over sites of |pseudo-gradient|^2, before averaging; the
    world's sum, that mean, once `own_square_summed`."""
    buckets: list[tuple[torch.Tensor, dist.Work | None, list[torch.Tensor]]] = field(
        default_factory=list
    )
    """(flat sync-dtype buffer, its all-reduce's handle, the deltas it holds)."""
    averaged: bool = False
    own_square_summed: bool = False


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of consecutive tensors of `sizes` elements in `fragments` groups of about equal
    size: a tensor goes to the group its middle element falls in (a group may be empty when
    there are fewer tensors than groups)."""
    total = max(sum(sizes), 1)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    before = 0
    for i, size in enumerate(sizes):
        groups[min(fragments - 1, int((before + size / 2) * fragments / total))].append(i)
        before += size
    return groups


class DiLoCo:
    """The outer optimizer of this rank's shards of `parts`: `after_step` runs the outer steps
    (of the fragments) that are due. Collective over the world at each outer step (the metrics'
    all-reduce)."""

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
        # By the parameters' full sizes: the same split on every rank, whatever it holds.
        self.fragments = split_fragments([p.numel() for _, p in self.params], cfg.fragments)
        skipped = {id(p) for p in counted_elsewhere}
        self.counted = [id(p) not in skipped for _, p in self.params]
        with torch.no_grad():
            self.global_weights = [local_tensor(p).detach().float().clone() for _, p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.global_weights]
        self.outer_steps = 0
        """Outer steps taken (of one fragment each under streaming)."""
        self.synced = True
        """Every site holds the global weights: the last inner step ended with every fragment's
        outer step and none in flight (a checkpoint there resumes at another site count)."""
        self.in_flight: _InFlight | None = None
        self.bytes_sent = 0.0
        """Bytes this rank sent for outer steps since `take_bytes` last read them."""
        self.pseudo_grad_norm: torch.Tensor | None = None
        """The norm of the averaged pseudo-gradient (of the fragment) at the last outer step (a
        device tensor), until `take_last_step` reads it."""
        self.drift: torch.Tensor | None = None
        """At the last outer step, the root mean square over sites of the distance between a
        site's pseudo-gradient (of the fragment) and their average (0 when every site moved
        alike), until `take_last_step` reads it."""

    def due_fragments(self, step: int) -> list[int]:
        """The fragments whose pseudo-gradients are averaged after inner step `step`."""
        if step == self.total_steps:
            return list(range(len(self.fragments)))
        h, count = self.cfg.inner_steps, len(self.fragments)
        return [f for f in range(count) if (step - f * h // count) % h == 0]

    def due(self, step: int) -> bool:
        return bool(self.due_fragments(step))

    def after_step(self, step: int) -> None:
        """Inner step `step` (1-based) is done: finish the fragment in flight if its outer step
        is due, then start (or, without overlap and at the last step, run) the due ones."""
        last = step == self.total_steps
        pending = self.in_flight
        if pending is not None and (pending.merge_step == step or last):
            self.in_flight = None
            self._outer_step(pending, mix=True)
        due = self.due_fragments(step)
        for fragment in due:
            if self.cfg.overlap_steps == 0 or last:
                self._outer_step(self._issue(fragment, merge_step=step), mix=False)
            else:
                self.in_flight = self._issue(fragment, merge_step=step + self.cfg.overlap_steps)
        self.synced = self.in_flight is None and len(due) == len(self.fragments)

    def manifest_notes(self) -> dict[str, bool]:
        """What a checkpoint's manifest records of the outer state (for
        `diloco_resume.site_change_problem`)."""
        return {SITES_SYNCED: self.synced}

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
    def _issue(self, fragment: int, *, merge_step: int) -> _InFlight:
        """Start averaging `fragment`'s pseudo-gradients over the sites, in flat buckets of the
        sync dtype, each all-reduce asynchronous."""
        members = self.fragments[fragment]
        deltas = (
            torch._foreach_sub(
                [self.global_weights[i] for i in members],
                [local_tensor(self.params[i][1]).float() for i in members],
            )
            if members
            else []
        )
        flight = _InFlight(fragment, merge_step, deltas, self._square_sum(deltas, members))
        dtype = _SYNC_DTYPES[self.cfg.sync_dtype]
        bucket: list[torch.Tensor] = []
        size = 0
        for i, delta in enumerate(deltas):
            bucket.append(delta)
            size += delta.numel()
            if size >= self.bucket_elements or i == len(deltas) - 1:
                flat = torch.cat([d.reshape(-1) for d in bucket]).to(dtype)
                work = dist.all_reduce(flat, group=self.sites, async_op=True)
                self.bytes_sent += wire_bytes("all_reduce", flat.nbytes, self.num_sites)
                flight.buckets.append((flat, work, bucket))
                bucket, size = [], 0
        return flight

    def _average(self, flight: _InFlight) -> None:
        """Wait for `flight`'s all-reduces and leave the average in its deltas."""
        if flight.averaged:
            return
        for flat, work, bucket in flight.buckets:
            if work is not None:
                work.wait()
            copy_from_flat(flat.float() / self.num_sites, bucket)
        flight.buckets.clear()
        flight.averaged = True

    @torch.no_grad()
    def _outer_step(self, flight: _InFlight, *, mix: bool) -> None:
        """The outer step of `flight`'s fragment; `mix`: the site trained on while it was in
        flight, so its weights are mixed with the new global ones (overlap_mix)."""
        self._average(flight)
        members = self.fragments[flight.fragment]
        deltas = flight.deltas
        # A restored flight's own squares are the world's sum already (`in_flight_state`).
        summed = flight.own_square_summed
        own = torch.zeros_like(flight.own_square) if summed else flight.own_square
        squares = torch.stack([own, self._square_sum(deltas, members)])
        if dist.get_world_size() > 1:
            dist.all_reduce(squares)
        if summed:
            squares[0] = flight.own_square
        # Mean over sites of |d_s|^2 minus |mean d|^2 = mean over sites of |d_s - mean d|^2.
        self.drift = (squares[0] - squares[1]).clamp(min=0).sqrt()
        self.pseudo_grad_norm = squares[1].sqrt()
        self.outer_steps += 1
        if not members:  # a fragment of no tensors (fewer tensors than fragments)
            return
        c = self.cfg
        weights = [self.global_weights[i] for i in members]
        update = deltas
        if c.outer_momentum > 0:
            momentum = [self.momentum[i] for i in members]
            torch._foreach_mul_(momentum, c.outer_momentum)
            torch._foreach_add_(momentum, deltas)
            update = (
                torch._foreach_add(deltas, momentum, alpha=c.outer_momentum)
                if c.nesterov
                else momentum
            )
        torch._foreach_add_(weights, update, alpha=-c.outer_lr)
        for i, global_ in zip(members, weights, strict=True):
            local = local_tensor(self.params[i][1])
            if mix:
                local.copy_(torch.lerp(global_, local.float(), c.overlap_mix))
            else:
                local.copy_(global_)

    def in_flight_state(self) -> dict[str, torch.Tensor]:
        """The fragment in flight as checkpoint entries, its average waited for (placed as the
        parameters) and its own squares summed over the world (collective, as a checkpoint
        is); `fragment` -1 when none. `load_in_flight` restores it."""
        flight = self.in_flight
        averaged = [torch.zeros_like(g) for g in self.global_weights]
        device = self.global_weights[0].device if self.params else torch.device("cpu")
        fragment, merge_step, own = -1, 0, torch.zeros((), device=device)
        if flight is not None:
            self._average(flight)
            for i, delta in zip(self.fragments[flight.fragment], flight.deltas, strict=True):
                averaged[i] = delta
            if not flight.own_square_summed:
                if dist.get_world_size() > 1:
                    dist.all_reduce(flight.own_square)
                flight.own_square_summed = True
            fragment, merge_step, own = flight.fragment, flight.merge_step, flight.own_square
        return {
            "fragment": torch.tensor(fragment),
            "merge_step": torch.tensor(merge_step),
            "own_square": own.detach().clone(),
            **{f"average.{k}": v for k, v in self.named(averaged).items()},
        }

    def load_in_flight(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `in_flight_state` gave (loaded)."""
        fragment = int(state["fragment"])
        if fragment < 0:
            self.in_flight = None
            return
        members = self.fragments[fragment]
        deltas = [local_tensor(state[f"average.{self.params[i][0]}"]).clone() for i in members]
        own = state["own_square"].to(self.global_weights[0].device)
        self.in_flight = _InFlight(
            fragment, int(state["merge_step"]), deltas, own, averaged=True, own_square_summed=True
        )

    def _square_sum(self, tensors: list[torch.Tensor], members: list[int]) -> torch.Tensor:
        """This rank's weighted share of the mean over sites of |tensors|^2 (shards of the
        parameters `members` indexes; summed over the world it is that mean, as
        parallel/grad_norm.py counts)."""
        total = torch.zeros((), device=self.global_weights[0].device if self.params else "cpu")
        for i, t in zip(members, tensors, strict=True):
            if self.counted[i]:
                total += local_square_sum(self.like(self.params[i][1], t), self.holders)
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


def outer_optimizer(
    diloco: DiLoCoConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    model: ParallelModel,
    *,
    total_steps: int,
    bucket_cap_mb: float,
) -> DiLoCo:
    """DiLoCo's outer optimizer over this rank's shards of `model`, its sites the dp_replicate
    axis of `mesh`, for `total_steps` inner steps (training.steps); `bucket_cap_mb`:
    comm.bucket_cap_mb."""
    sites = mesh["dp_replicate"]
    return DiLoCo(
        model.parts,
        diloco,
        sites=sites.get_group(),
        site=sites.get_local_rank(),
        total_steps=total_steps,
        holders=dims.world_size // dims.pp,
        bucket_cap_mb=bucket_cap_mb,
        counted_elsewhere=model.counted_elsewhere,
    )
