"""The distributed, resumable batch loader and the fixed validation batches.

All ranks agree on one global sample stream. Global position g is supplied by the source that the
mixture picks for it (mixture.py; a single dataset supplies every position), at that source's
next position, in that source's own order (order.py): for one token file, epoch e visits every
sample in the order `default_rng([seed, e]).permutation(N)`. Each step takes the next
global_batch_size positions and rank r reads the r-th contiguous slice of them. The stream does
not depend on the layout, so concatenating every rank's micro-batches in rank order gives exactly
the one-process batch: that is what makes N-rank losses match 1-rank losses, and why a
checkpoint's state, the global position and each source's position, resumes on any number of
ranks, at once (nothing is replayed).

With data.prefetch_batches > 0 a background thread prepares the next batches while the step runs
(reading, and for remote shards telling the shard store what comes next); `data_wait_s` is the
time steps spent waiting for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Literal

import numpy as np
import torch

from distrain.data.corpus import DataError
from distrain.data.dataset import Batch, TokenDataset, too_small_for_a_batch
from distrain.data.documents import drop_uncounted, packed_sample
from distrain.data.mixture import Mixture
from distrain.observe.logs import LOGGER_NAME

_STOP = object()


class DistributedBatchLoader:
    """This rank's micro-batches of the global sample stream; `state_dict` makes it Stateful."""

    def __init__(
        self,
        data: TokenDataset | Mixture,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        prefetch_batches: int = 0,
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
        mixture = data if isinstance(data, Mixture) else Mixture.single(data, seed=seed)
        for source in mixture.sources:
            of = f" of {source.name!r}" if len(mixture.sources) > 1 else ""
            if len(source) < global_batch_size:
                raise too_small_for_a_batch(
                    len(source), source.dataset.seq_len, global_batch_size, of
                )
        self.mixture = mixture
        self.dataset = mixture.sources[0].dataset
        self.seq_len = self.dataset.seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.prefetch_batches = prefetch_batches
        self.accum_steps = global_batch_size // (micro_batch_size * dp_size)
        self.samples_consumed = 0
        self.positions = np.zeros(len(mixture.sources), dtype=np.int64)
        """Samples each source has supplied to the batches handed out so far."""
        self.wait_s = 0.0
        """Seconds next_batch waited for data since the last `take_wait_s`."""
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()

    @property
    def samples_per_rank_per_epoch(self) -> int:
        """Samples this rank reads from stream positions [0, N): G/D per full global batch, plus
        its slice of the final partial batch. Ranks past that partial batch's end read fewer, which
        is what the data-skew check reports (every step still gives each rank G/D samples)."""
        n, share = len(self.mixture), self.global_batch_size // self.dp_size
        partial = n % self.global_batch_size
        in_partial = min(max(partial - self.dp_rank * share, 0), share)
        return (n // self.global_batch_size) * share + in_partial

    def _read(self, consumed: int, positions: np.ndarray) -> tuple[Batch, np.ndarray]:
        """This rank's share of the global batch at `consumed` (sources at `positions`), and the
        sources' positions after the whole global batch."""
        g, share = self.global_batch_size, self.global_batch_size // self.dp_size
        choice = self.mixture.choose(consumed, consumed + g)
        mine = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        windows = np.empty((share, self.seq_len + 1), dtype=np.int64)
        masked = self.mixture.sources[0].dataset.documents is not None
        ids = np.empty_like(windows) if masked else None
        weighed = any(s.dataset.loss_mask is not None for s in self.mixture.sources)
        counted = np.ones(windows.shape, np.uint8) if weighed else None
        after = positions.copy()
        for s, source in enumerate(self.mixture.sources):
            taken = choice == s
            at = positions[s] + np.cumsum(taken) - 1
            after[s] += int(taken.sum())
            source.want_from(int(positions[s]))
            rows = np.flatnonzero(taken[mine])
            if rows.size:
                samples = source.order.samples(at[mine][rows])
                windows[rows] = source.dataset.windows(samples)
                if ids is not None:
                    ids[rows] = source.dataset.document_ids(samples, windows[rows])
                if counted is not None and source.dataset.loss_mask is not None:
                    counted[rows] = source.dataset.counted(samples)
        parts = (windows[:, :-1], windows[:, 1:]) if ids is None else packed_sample(windows, ids)
        if counted is not None:
            parts = (parts[0], parts[1].copy(), *parts[2:])
            drop_uncounted(parts[1], counted)
        # numpy copies and zero-copy tensors: no torch op runs on this (possibly background)
        # thread, whose intra-op threads would compete with the step's.
        return tuple(torch.from_numpy(np.ascontiguousarray(p)) for p in parts), after

    def _produce(self, consumed: int, positions: np.ndarray, out: queue.Queue) -> None:
        try:
            while not self._halt.is_set():
                batch, positions = self._read(consumed, positions)
                consumed += self.global_batch_size
                item = (batch, consumed, positions)
                while not self._halt.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the step that needs the batch
            out.put(e)

    def _next_global(self) -> tuple[Batch, int, np.ndarray]:
        if self.prefetch_batches == 0:
            batch, after = self._read(self.samples_consumed, self.positions)
            return batch, self.samples_consumed + self.global_batch_size, after
        if self._thread is None:
            self._halt.clear()
            self._queue = queue.Queue(self.prefetch_batches)
            self._thread = threading.Thread(
                target=self._produce,
                args=(self.samples_consumed, self.positions.copy(), self._queue),
                name="batch-loader",
                daemon=True,
            )
            self._thread.start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def next_batch(self) -> list[Batch]:
        """accum_steps micro-batches (inputs, targets[, documents]) of micro_batch_size samples
        each."""
        start = time.perf_counter()
        batch, self.samples_consumed, self.positions = self._next_global()
        self.wait_s += time.perf_counter() - start
        m = self.micro_batch_size
        return [tuple(p[i : i + m] for p in batch) for i in range(0, batch[0].shape[0], m)]

    def take_wait_s(self) -> float:
        """The data wait since the last call, and start counting again."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def tokens_per_source(self) -> dict[str, int]:
        """Target tokens each source has supplied to the run so far."""
        return {
            name: int(p) * self.seq_len
            for name, p in zip(self.mixture.names, self.positions, strict=True)
        }

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the split of each rank's share (after an out-of-memory step, say); the global
        batch, and so the math, stay the same."""
        share = self.global_batch_size // self.dp_size
        if micro_batch_size < 1 or share % micro_batch_size:
            raise ValueError(f"micro-batch {micro_batch_size} does not divide the share {share}")
        self.micro_batch_size = micro_batch_size
        self.accum_steps = share // micro_batch_size

    def close(self) -> None:
        """Stop the background thread; the next batch starts it again where the stream is."""
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
            self._thread, self._queue = None, None

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
        self.close()  # batches read ahead were this rank's slices of the old split
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum_steps = self.global_batch_size // (self.micro_batch_size * dp_size)

    def state_dict(self) -> dict:
        # Tensors only: checkpoints load with weights_only / DCP, which refuse arbitrary objects.
        state: dict = {"samples_consumed": torch.tensor(self.samples_consumed, dtype=torch.int64)}
        if len(self.mixture.sources) > 1:
            state["sources"] = {
                name: {
                    "position": torch.tensor(int(p), dtype=torch.int64),
                    "weight": torch.tensor(float(w), dtype=torch.float64),
                }
                for name, p, w in zip(
                    self.mixture.names, self.positions, self.mixture.weights, strict=True
                )
            }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.close()
        self.samples_consumed = int(state_dict["samples_consumed"])
        if len(self.mixture.sources) == 1:
            self.positions[:] = self.samples_consumed
            return
        saved = state_dict["sources"]
        self.positions = np.array([int(saved[n]["position"]) for n in self.mixture.names])
        before = np.array([float(saved[n]["weight"]) for n in self.mixture.names])
        if not np.allclose(before, self.mixture.weights, rtol=0, atol=1e-12):
            logging.getLogger(LOGGER_NAME).info(
                "data: mixture weights changed (%s); each source continues where it stopped (%s)",
                ", ".join(
                    f"{n} {b:.4g} -> {w:.4g}"
                    for n, b, w in zip(
                        self.mixture.names, before, self.mixture.weights, strict=True
                    )
                ),
                ", ".join(
                    f"{n} at sample {p}"
                    for n, p in zip(self.mixture.names, self.positions, strict=True)
                ),
            )


EVAL_TOKENS = 1 << 17
"""training.eval_batches = "auto": the most tokens a validation pass reads (131,072, 1,024
sequences of 128 tokens), which bounds its cost on a large split."""


def val_sample(
    samples: int, *, num_batches: int | Literal["auto"], global_batch_size: int, seq_len: int
) -> np.ndarray:
    """The indices of the fixed validation set of a split of `samples` sequences:
    num_batches * global_batch_size of them, spread evenly over the whole split (sample
    floor(k * samples / count) for k < count), or the whole split in order, wrapping, when it
    holds no more than that. num_batches = "auto" is as many whole global batches as the split
    holds, at most EVAL_TOKENS tokens' worth (at least one batch). The set depends on neither the
    layout nor the world size."""
    if samples == 0:
        raise DataError("the validation split has no samples; use more data or data.val_fraction")
    if num_batches == "auto":
        num_batches = max(1, min(samples, EVAL_TOKENS // seq_len) // global_batch_size)
    count = num_batches * global_batch_size
    if count >= samples:
        return np.arange(count, dtype=np.int64) % samples
    return np.arange(count, dtype=np.int64) * samples // count


def val_batches(
    dataset: TokenDataset,
    *,
    num_batches: int | Literal["auto"],
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> list[Batch]:
    """This rank's share of the fixed validation set of `dataset` (`val_sample`), in
    micro-batches: each of the dp_size ranks a contiguous 1/dp_size of it. The set depends on
    neither the layout nor the world size, so every layout's validation loss (the sums over the
    ranks) is the one-process loss over the same samples."""
    sample = val_sample(
        len(dataset),
        num_batches=num_batches,
        global_batch_size=global_batch_size,
        seq_len=dataset.seq_len,
    )
    share = len(sample) // dp_size
    indices = sample[dp_rank * share : (dp_rank + 1) * share]
    m = micro_batch_size
    return [dataset.get_batch(indices[i : i + m]) for i in range(0, share, m)]
