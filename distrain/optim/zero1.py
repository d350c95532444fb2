"""ZeRO stage 1 for tensor- and pipeline-parallel layouts: AdamW whose state is partitioned over
the data-parallel ranks of each tp/pp group (Megatron's distributed optimizer, without its
gradient reduce-scatter: the gradients stay all-reduced, as ZeRO-1 leaves them).

torch's ZeroRedundancyOptimizer, which serves plain data parallel, broadcasts whole parameters
and so cannot take DTensor parameters (tp, and FSDP2's replication under tp/pp). Here every
parameter is handled through its local tensor (`to_local()`): each data-parallel rank owns a
share of the parameters, keeps AdamW state for those only, updates them, and then each owner
broadcasts its updated local tensors to the other data-parallel ranks of its group, one flat
buffer per owner. A tp rank's data-parallel group holds the same slice of each parameter on
every member, so the owner's slice is the one they all need.

The shape of the class follows ZeroRedundancyOptimizer's (`optim` is this rank's own AdamW,
`param_groups` hold every parameter), so the optimizer state is saved and loaded the same way
for both (builder.py): each rank its own share, under the parameters' names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain.parallel.local import copy_from_flat, local_tensor


def owners(params: list[nn.Parameter], size: int) -> list[int]:
    """The data-parallel rank that owns each parameter: largest first to the least-loaded rank
    (counting local elements), so every rank of the group holds about 1/size of the state. Pure
    function of the shapes, so every rank of the group computes the same answer."""
    loads = [0] * size
    owner = [0] * len(params)
    order = sorted(range(len(params)), key=lambda i: (-local_tensor(params[i]).numel(), i))
    for i in order:
        rank = min(range(size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += local_tensor(params[i]).numel()
    return owner


class Zero1AdamW(torch.optim.Optimizer):
    """AdamW with its state sharded over `group` (the data-parallel group of this tp/pp rank).
    Gradients must be averaged over `group` before `step` (FSDP2 does, in backward)."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        group: dist.ProcessGroup,
        own_params: Collection[nn.Parameter] = (),
        **options: Any,
    ):
        """`own_params`: parameters whose local tensor differs between the ranks of `group`
        (expert weights split over ep): every rank updates its own and broadcasts none, their
        state being split already (over ep, and by FSDP2 over the rest)."""
        super().__init__(param_groups, options)
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        own = {id(p) for p in own_params}
        self._params = [p for g in self.param_groups for p in g["params"] if id(p) not in own]
        self._owner = owners(self._params, size)
        self._own = [p for g in self.param_groups for p in g["params"] if id(p) in own]
        self._params += self._own
        self._owner += [rank] * len(self._own)
        self._owner_global = [dist.get_global_rank(group, r) for r in range(size)]
        owned = {id(p) for p, r in zip(self._params, self._owner, strict=True) if r == rank}
        # The groups this rank owns parameters of (torch's state-dict code cannot take an empty
        # group), each with the index of its group in `param_groups`.
        mine = [
            (i, {**g, "params": [p for p in g["params"] if id(p) in owned]})
            for i, g in enumerate(self.param_groups)
        ]
        mine = [(i, g) for i, g in mine if g["params"]]
        self._group_index = [i for i, _ in mine]
        self.owns_nothing = not mine
        """More data-parallel ranks than parameters leave some ranks without a share."""
        self.optim = torch.optim.AdamW([g for _, g in mine] or [{"params": []}], **options)

    def _sync_hyperparameters(self) -> None:
        """The trainer sets lr on `param_groups`; the owned-share AdamW steps with it."""
        for mine, index in zip(self.optim.param_groups, self._group_index, strict=False):
            mine.update({k: v for k, v in self.param_groups[index].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self._sync_hyperparameters()
        loss = self.optim.step(closure)
        self._broadcast_updates()
        return loss

    @torch.no_grad()
    def _broadcast_updates(self) -> None:
        """Each owner sends its updated local tensors to the group, one flat buffer per
        (owner, dtype): `size` broadcasts a step rather than one per parameter."""
        buckets: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        shared = len(self._params) - len(self._own)
        for param, owner in zip(self._params[:shared], self._owner[:shared], strict=True):
            local = local_tensor(param)
            buckets.setdefault((owner, local.dtype), []).append(local)
        for (owner, _dtype), tensors in buckets.items():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self._owner_global[owner], group=self.group)
            if dist.get_rank(self.group) != owner:
                copy_from_flat(flat, tensors)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
