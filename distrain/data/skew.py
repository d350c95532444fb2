"""The data-skew check: do data-parallel ranks read (nearly) the same number of samples?

Ranks that read unequal shares of the data weight the corpus unevenly (or, with loaders that stop
at the end of their shard, run different numbers of steps and hang a collective). The check gathers
each rank's count once at startup and warns or stops the run.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch
import torch.distributed as dist

from distrain.data.corpus import DataError

_CPU = torch.device("cpu")


def skew_message(counts: list[int], max_skew: float) -> str | None:
    """A one-line complaint when (max - min) / max of the counts exceeds max_skew, else None."""
    largest = max(counts)
    skew = (largest - min(counts)) / largest if largest > 0 else 0.0
    if skew <= max_skew:
        return None
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    return (
        f"data skew {skew:.3f} exceeds data.max_skew {max_skew} (samples per rank: {per_rank}); "
        "balance the data or raise data.max_skew (data.skew_action=error stops the run)"
    )


def check_data_skew(
    local_count: int,
    *,
    max_skew: float,
    action: Literal["warn", "error"],
    group: dist.ProcessGroup | None = None,
    logger: logging.Logger | None = None,
    device: torch.device = _CPU,
) -> list[int]:
    """Gather every rank's sample count over `group` and act on too much skew. `device` holds the
    gathered tensor: CPU for gloo, the rank's GPU for NCCL. Returns the counts in rank order."""
    if not dist.is_initialized():
        counts = [local_count]
    else:
        local = torch.tensor([local_count], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        counts = [int(t.item()) for t in gathered]
    message = skew_message(counts, max_skew)
    if message is not None:
        if action == "error":
            raise DataError(message)
        if logger is not None:
            logger.warning(message)
        else:
            warnings.warn(message, stacklevel=2)
    return counts
