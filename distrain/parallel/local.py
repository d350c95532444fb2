"""This rank's values of parameters and gradients, for the collectives distrain writes by hand
(ZeRO-1's broadcasts, 1-bit Adam, the OOM path's all-reduce, replica checks, clipping).

Under tensor parallelism (and FSDP2) a parameter or gradient is a DTensor; a collective, a
fingerprint or an in-place update works on the shard this rank holds. Flat buffers put many
such tensors into one collective and are copied back afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of `t`: a DTensor's local shard (in-place ops on it change `t`), or
    `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def copy_from_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive spans of `flat` into `tensors`, each in its own shape: the inverse of
    `torch.cat([t.reshape(-1) for t in tensors])`."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
