"""The batch arithmetic of a run, computed in one place: the global batch is split over the
data-parallel ranks (the local batch), and each rank's share into micro-batches (accumulation
steps). The layout rules, the trainer and the model runner read these numbers here; the rules
check that each division is exact before anything reads them."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizes:
    global_batch: int
    """Sequences per optimizer step, over every data-parallel rank (training.global_batch_size)."""
    dp: int
    """Data-parallel ranks the global batch is split over (`ParallelDims.dp_size`)."""
    micro: int
    """Sequences per forward/backward pass (the decided one, for training.micro_batch_size =
    'auto')."""

    @property
    def local(self) -> int:
        """Sequences per step on one data-parallel rank."""
        return self.global_batch // self.dp

    @property
    def accumulation(self) -> int:
        """Micro-batches per step on one data-parallel rank."""
        return self.local // self.micro

    def with_micro(self, micro: int) -> BatchSizes:
        return replace(self, micro=micro)
