"""Expert parallelism (EP): the experts of each MoE layer split over the `ep` axis, tokens sent
to the rank that holds their expert and back with `all_to_all_single`.

`apply_expert_parallel` replaces every `moe.experts` (a GroupedExperts, whose weights are stacked
[num_experts, ...]) with an `ExpertParallel` that owns the same weights under the same names,
now DTensors sharded Shard(0) over the ep mesh: rank r holds experts r*L .. (r+1)*L-1 (L =
num_experts / ep). Names and global shapes are those of the unsplit model, so seeded init,
DCP checkpoints and resharding across ep degrees need nothing EP-specific. FSDP2 then shards
these weights further over the data-parallel ranks EP does not use (`dp_mod_ep`), as torchtitan
does (data_parallel.py's `apply_fsdp` with `expert_mesh`).

One forward of an ExpertParallel, on rows already sorted by global expert:
1. counts: every rank sends each peer how many rows it has for each of that peer's experts
   (an all-to-all of num_experts int64 values), then reads the counts on the host: uneven
   `all_to_all_single` takes its split sizes as Python ints, one device-to-host sync per MoE
   layer and forward, which torchtitan and Megatron pay as well (dropless routing cannot know
   the sizes in advance).
2. dispatch: the rows go to their experts' ranks; they arrive grouped by source rank, then by
   local expert, and are regrouped by local expert for the grouped expert computation.
3. combine: the results go back in the reverse order, so the caller sees its own rows in its
   own order. Both exchanges are differentiable (the backward is the reverse exchange).

Gradients: an expert's weight gradient on its rank sums the gradients of every ep rank's rows
(the backward exchange brought them there), where data parallelism wants their mean over the
data-parallel ranks: it is divided by ep here and FSDP averages over dp_mod_ep, giving the mean
over ep x dp_mod_ep = all data-parallel ranks. (Not FSDP's `set_gradient_divide_factor`: it
reduces with PREMUL_SUM, which gloo lacks.)

A rank's counts depend only on its own tokens, so routing, capacity drops and statistics stay
where moe.py computes them: on the rank that routes, before any exchange.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.func import functional_call

from distrain.parallel.compress import CommStats
from distrain.torch_compat import is_fake


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; its backward sends gradients back along
    the same routes."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallel(nn.Module):
    """Stands in for one GroupedExperts: same forward signature, same parameter names.

    The weights are Parameters of this module (DTensors, Shard(0) over the ep mesh); the
    GroupedExperts is kept unregistered and runs on this rank's slices through
    `functional_call`, so moe.py reads the local expert count from the weights it is given.
    """

    def __init__(
        self,
        experts: nn.Module,
        ep_mesh: DeviceMesh,
        *,
        capacity_factor: float = 0.0,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__()
        self.ep_mesh, self.stats = ep_mesh, stats
        self.capacity_factor = capacity_factor  # the MoE layer's (moe.py): fake routes' bound
        self.ep = ep_mesh.size()
        self.names = [name for name, _ in experts.named_parameters(recurse=False)]
        for name in self.names:
            full = getattr(experts, name)
            # The local slice of a torch.chunk split (exact: layout/rules.py makes ep divide E).
            local = full.detach().chunk(self.ep)[ep_mesh.get_local_rank()].clone()
            sharded = DTensor.from_local(
                local, ep_mesh, (Shard(0),), run_check=False, shape=full.shape, stride=full.stride()
            )
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        self.num_experts = getattr(experts, self.names[0]).shape[0]
        # Not a submodule: its own (full-size, never materialized) weights must not be
        # parameters of the model.
        object.__setattr__(self, "inner", experts)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        per_rank = self.num_experts // self.ep
        received = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(received, num_tokens_per_expert, group=group)
        send_splits, recv_splits, order = self._routes(x, num_tokens_per_expert, received)
        self._count_bytes(x, send_splits, recv_splits)
        rows = _AllToAll.apply(x, recv_splits, send_splits, group)
        order = order.to(x.device)
        local_counts = received.view(self.ep, per_rank).sum(0)
        weights = {
            name: _ScaleGrad.apply(getattr(self, name).to_local(), 1.0 / self.ep)
            for name in self.names
        }
        out = functional_call(self.inner, weights, (rows[order], local_counts))
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return _AllToAll.apply(out[back], send_splits, recv_splits, group)

    def _routes(
        self, x: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each ep rank, rows received from each, the order of the received rows
        by local expert) from this rank's counts per expert (`sent`) and its peers' for its
        experts (`received`), in one host read of both (see the module docstring). A fake
        tensor (the planner's fake build) has no counts to read: this rank sends each an even
        share of its rows, and receives from each the most a router can send it
        (`_most_received`)."""
        if is_fake(received):
            rows = x.shape[0]
            shares = [rows // self.ep + (r < rows % self.ep) for r in range(self.ep)]
            mine = [self._most_received(rows, shares[self.ep_mesh.get_local_rank()])] * self.ep
            return shares, mine, torch.arange(sum(mine))
        per_rank = self.num_experts // self.ep
        counts = torch.cat([sent, received]).cpu()
        send = counts[: self.num_experts].view(self.ep, per_rank)
        recv = counts[self.num_experts :].view(self.ep, per_rank)
        return send.sum(1).tolist(), recv.sum(1).tolist(), _by_local_expert(recv)

    def _most_received(self, rows: int, even: int) -> int:
        """The rows a peer that routes `rows` copies sends this rank at most: with a capacity,
        each of this rank's experts full (ceil(factor x copies / experts) each, the copies of a
        factor of 1 or more all kept), at most all its rows; dropless, a trained router has no
        bound short of every row, and the plan prices the balanced `even` share."""
        if self.capacity_factor <= 0:
            return even
        capacity = math.ceil(max(1.0, self.capacity_factor) * rows / self.num_experts)
        return max(even, min(rows, capacity * (self.num_experts // self.ep)))

    def _count_bytes(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> None:
        """Rows this rank sends to other ranks, dispatch now and combine later (their results
        come back the way the received rows came), forward only."""
        if self.stats is None:
            return
        me = self.ep_mesh.get_local_rank()
        rows = sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]
        self.stats.add_all_to_all(rows * math.prod(x.shape[1:]) * x.element_size())


def _by_local_expert(recv: torch.Tensor) -> torch.Tensor:
    """Row order that turns received rows, grouped [source rank][local expert], into rows
    grouped [local expert][source rank] (each source's rows in their original order)."""
    sizes = recv.flatten().tolist()
    starts = [0, *itertools.accumulate(sizes)]
    ranks, per_rank = recv.shape
    blocks = [r * per_rank + e for e in range(per_rank) for r in range(ranks)]
    return torch.cat([torch.arange(starts[b], starts[b] + sizes[b]) for b in blocks])


def expert_modules(module: nn.Module) -> list[ExpertParallel]:
    return [m for m in module.modules() if isinstance(m, ExpertParallel)]


def apply_expert_parallel(
    layers: list[nn.Module], ep_mesh: DeviceMesh, *, stats: CommStats | None = None
) -> list[ExpertParallel]:
    """Replace the `experts` of every MoE layer in `layers` (a model's or stage's, as its
    family's spec lists them; meta or materialized) by an ExpertParallel over the 1-D
    `ep_mesh`; returns them (for FSDP to wrap)."""
    wrapped = []
    for layer in layers:
        layer.experts = ExpertParallel(
            layer.experts, ep_mesh, capacity_factor=layer.args.capacity_factor, stats=stats
        )
        wrapped.append(layer.experts)
    return wrapped
