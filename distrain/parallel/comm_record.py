"""The collectives a block of code issues, as the dispatcher sees them (`RecordCollectives`):
each one's kind, message bytes and group size, and what this rank sent for them on the wire
(compress.py's `wire_bytes`). It sees every collective that goes through torch's c10d ops
(FSDP2's all-gathers and reduce-scatters, tensor parallelism's, context parallelism's, pipeline
sends, DDP's all-reduces, gradient norms), on real process groups and on the planner's fake
ones, in eager code; a compiled graph is not entered with it (the mode would recompile it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from distrain.parallel.compress import wire_bytes

# Dispatcher op name -> (kind, index of the argument whose bytes are the message, whether the
# message is that argument times the group size: a functional all-gather's argument is its input).
# An all-gather's message is its whole output, a reduce-scatter's its whole input.
_OPS = {
    "_c10d_functional.all_reduce": ("all_reduce", 0, False),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, True),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "c10d.allreduce_": ("all_reduce", 0, False),
    "c10d._allgather_base_": ("all_gather", 0, False),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, False),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "c10d.broadcast_": ("broadcast", 0, False),
    "c10d.alltoall_base_": ("all_to_all", 1, False),
    "c10d.send": ("send", 0, False),
}


@dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: int
    group_size: int

    @property
    def wire_bytes(self) -> float:
        """What this rank sends for it (`wire_bytes`, whose all-gather takes this rank's part of
        the output; a send is its message)."""
        if self.kind == "send":
            return float(self.nbytes)
        if self.kind == "all_gather":
            return wire_bytes(self.kind, self.nbytes / self.group_size, self.group_size)
        return wire_bytes(self.kind, self.nbytes, self.group_size)


class RecordCollectives(TorchDispatchMode):
    """Every collective issued inside the block, with its message bytes and group size."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = f"{func.namespace}.{func.__name__.split('.')[0]}"
        if name in _OPS:
            kind, index, times_group = _OPS[name]
            size = _group_size(args, kwargs)
            nbytes = _nbytes(args[index]) * (size if times_group else 1)
            self.found.append(Collective(kind, nbytes, size))
        return func(*args, **(kwargs or {}))

    def wire_bytes(self) -> float:
        """What this rank sent for the collectives found."""
        return sum(c.wire_bytes for c in self.found if c.group_size > 1)


def _nbytes(value: Any) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _group_size(args: tuple, kwargs: dict) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.distributed.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the group boxed
            return torch.distributed.ProcessGroup.unbox(a).size()
    # Functional collectives name their group last: (tensor, [reduce op,] [group size,] name).
    name = (*args, *kwargs.values())[-1]
    return _resolve_process_group(name).size()
