"""Cross-rank sanity check (`debug.check_replicas`): parameters must agree across data-parallel
replicas. Shards along dp_shard, tp and pp legitimately differ, so the check runs over the
dp_replicate axis only, where every rank holds the same local tensors. Expert weights under
expert parallelism (DTensors on a mesh with an `ep` axis) are split over data-parallel ranks
rather than replicated there, so they are left out.

`check_shared_copies` covers the values held alike outside the dp_replicate axis: parameters
replicated over tp (the same on every tp rank) and the two copies of an embedding tied across the
first and last pipeline stage.

Each rank reduces every local parameter to two float64 fingerprints (a plain sum and a
position-weighted sum) and the ranks all-gather them: one small collective, exact for identical
tensors (same ops on the same bits), and a differing tensor names itself and the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.errors import DistrainError
from distrain.parallel.local import local_tensor
from distrain.torch_compat import canonical_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from distrain.parallel.model import ParallelModel


class ReplicaMismatchError(DistrainError):
    """Data-parallel replicas hold different parameters: a parallelism bug, not user error."""


def fingerprints(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().double().flatten()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * weights.reciprocal()).sum()])


def mismatches(names: list[str], gathered: torch.Tensor, ranks: list[int]) -> list[str]:
    """gathered: [replicas, params, 2]; one message per parameter not the same everywhere."""
    found = []
    for i, name in enumerate(names):
        values = gathered[:, i]
        groups: dict[tuple[float, float], list[int]] = {}
        for replica, rank in enumerate(ranks):
            groups.setdefault(tuple(values[replica].tolist()), []).append(rank)
        if len(groups) > 1:
            split = " vs ".join(str(members) for members in groups.values())
            found.append(f"{name} differs across data-parallel replicas: ranks {split}")
    return found


def check_replicas(parts: list[nn.Module], replicate_group: dist.ProcessGroup) -> None:
    size = dist.get_world_size(replicate_group)
    if size == 1:
        return
    names, prints = [], []
    for part in parts:
        for name, param in part.named_parameters():
            if isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ()):
                continue
            names.append(canonical_name(name))
            prints.append(fingerprints(local_tensor(param)))
    local_prints = torch.stack(prints)
    gathered = [torch.empty_like(local_prints) for _ in range(size)]
    dist.all_gather(gathered, local_prints, group=replicate_group)
    found = mismatches(
        names, torch.stack(gathered).cpu(), dist.get_process_group_ranks(replicate_group)
    )
    if found:
        raise ReplicaMismatchError(f"{len(found)} parameter(s) out of sync; first: {found[0]}")


def check_all_replicas(model: ParallelModel, mesh: DeviceMesh) -> None:
    """`check_replicas` over the dp_replicate axis, then `check_shared_copies`. Collective."""
    check_replicas(model.parts, mesh["dp_replicate"].get_group())
    tied = model.tied
    check_shared_copies(
        model.parts,
        mesh["tp"].get_group(),
        tied.copy if tied is not None else None,
        tied.group if tied is not None else None,
        tied_name=tied.name if tied is not None else "",
    )


def check_shared_copies(
    parts: list[nn.Module],
    tp_group: dist.ProcessGroup,
    tied_copy: nn.Parameter | None,
    tied_group: dist.ProcessGroup | None,
    *,
    tied_name: str,
) -> None:
    """The parameters replicated over tp agree across `tp_group` (every tp rank of a stage holds
    the same ones), and this rank's copy of a tied embedding agrees with the other stage's
    (`tied_group`: the first and last pipeline rank). Collective over both groups."""
    if dist.get_world_size(tp_group) > 1:
        named = [
            (canonical_name(name), param.to_local())
            for part in parts
            for name, param in part.named_parameters()
            if isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements)
        ]
        _compare(named, tp_group, "tensor-parallel ranks")
    if tied_copy is not None and tied_group is not None:
        _compare([(f"{tied_name} (tied)", local_tensor(tied_copy))], tied_group, "pipeline stages")


def _compare(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, what: str) -> None:
    if not named:
        return
    local_prints = torch.stack([fingerprints(t) for _, t in named])
    gathered = [torch.empty_like(local_prints) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local_prints, group=group)
    names = [name for name, _ in named]
    found = mismatches(names, torch.stack(gathered).cpu(), dist.get_process_group_ranks(group))
    if found:
        first = found[0].replace("data-parallel replicas", what)
        raise ReplicaMismatchError(f"{len(found)} parameter(s) out of sync; first: {first}")
