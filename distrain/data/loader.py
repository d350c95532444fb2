"""The distributed, resumable batch loader and the fixed validation batches.

All ranks agree on one global sample stream: epoch e visits every sample in the order
`default_rng([seed, e]).permutation(N)`, and epochs follow each other without a gap. Each step takes
the next global_batch_size samples of that stream and rank r reads the r-th contiguous slice of it.
The stream does not depend on the layout, so concatenating every rank's micro-batches in rank order
gives exactly the one-process batch: that is what makes N-rank losses match 1-rank losses, and why a
checkpoint's single `samples_consumed` resumes on any number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from distrain.data.corpus import DataError
from distrain.data.dataset import TokenDataset

Batch = tuple[torch.Tensor, torch.Tensor]


class DistributedBatchLoader:
    """This rank's micro-batches of the global sample stream; `state_dict` makes it Stateful."""

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if global_batch_size <= 0 or micro_batch_size <= 0 or dp_size <= 0:
            raise ValueError(
                f"batch sizes and data-parallel size must be > 0 (training.global_batch_size "
                f"{global_batch_size}, training.micro_batch_size {micro_batch_size}, "
                f"data-parallel size {dp_size})"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"training.global_batch_size ({global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if len(dataset) < global_batch_size:
            raise DataError(
                f"the data set is too small: the training split holds {len(dataset)} sequences "
                f"of {dataset.seq_len} tokens, one global batch needs {global_batch_size} "
                "(training.global_batch_size); use more data (data.path, data.max_bytes), a "
                "smaller training.global_batch_size or a shorter training.seq_len"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.accum_steps = global_batch_size // (micro_batch_size * dp_size)
        self.samples_consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def samples_per_rank_per_epoch(self) -> int:
        """Samples this rank reads from stream positions [0, N): G/D per full global batch, plus
        its slice of the final partial batch. Ranks past that partial batch's end read fewer, which
        is what the data-skew check reports (every step still gives each rank G/D samples)."""
        n, share = len(self.dataset), self.global_batch_size // self.dp_size
        partial = n % self.global_batch_size
        in_partial = min(max(partial - self.dp_rank * share, 0), share)
        return (n // self.global_batch_size) * share + in_partial

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(len(self.dataset))
        return self._perms[epoch]

    def _stream(self, start: int, stop: int) -> np.ndarray:
        """Dataset indices at global stream positions [start, stop), across epoch boundaries."""
        n = len(self.dataset)
        parts = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            take = min(stop - pos, n - offset)
            parts.append(self._perm(epoch)[offset : offset + take])
            pos += take
        return np.concatenate(parts)

    def next_batch(self) -> list[Batch]:
        """accum_steps micro-batches (inputs, targets) of micro_batch_size samples each."""
        share = self.global_batch_size // self.dp_size
        start = self.samples_consumed + self.dp_rank * share
        indices = self._stream(start, start + share)
        self.samples_consumed += self.global_batch_size
        current_epoch = self.samples_consumed // len(self.dataset)
        self._perms = {e: p for e, p in self._perms.items() if e >= current_epoch}
        m = self.micro_batch_size
        return [self.dataset.get_batch(indices[i : i + m]) for i in range(0, share, m)]

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the split of each rank's share (after an out-of-memory step, say); the global
        batch, and so the math, stay the same."""
        share = self.global_batch_size // self.dp_size
        if micro_batch_size < 1 or share % micro_batch_size:
            raise ValueError(f"micro-batch {micro_batch_size} does not divide the share {share}")
        self.micro_batch_size = micro_batch_size
        self.accum_steps = share // micro_batch_size

    def replan(self, *, dp_rank: int, dp_size: int) -> None:
        """Read the `dp_rank`-th of `dp_size` slices of each global batch from now on (the
        ranks alive changed): the global batch, and so the math, stay the same."""
        if dp_size <= 0 or self.global_batch_size % (self.micro_batch_size * dp_size):
            raise ValueError(
                f"training.global_batch_size ({self.global_batch_size}) does not split into "
                f"micro-batches of {self.micro_batch_size} over {dp_size} data-parallel ranks"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum_steps = self.global_batch_size // (self.micro_batch_size * dp_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Tensors only: checkpoints load with weights_only / DCP, which refuse arbitrary objects.
        return {"samples_consumed": torch.tensor(self.samples_consumed, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.samples_consumed = int(state_dict["samples_consumed"])
        self._perms.clear()


def val_batches(
    dataset: TokenDataset, *, num_batches: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """This rank's share of a fixed validation set: the first num_batches * micro_batch_size *
    dp_size val samples in index order (wrapping when the split is smaller), as num_batches
    micro-batches. Every rank gets the same count, so the mean of per-rank mean losses equals the
    one-process mean over the same samples, and evaluations are comparable across runs."""
    if len(dataset) == 0:
        raise DataError("the validation split has no samples; use more data or data.val_fraction")
    share = num_batches * micro_batch_size
    indices = np.arange(dp_rank * share, (dp_rank + 1) * share) % len(dataset)
    m = micro_batch_size
    return [dataset.get_batch(indices[i : i + m]) for i in range(0, share, m)]
