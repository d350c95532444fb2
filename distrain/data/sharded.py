"""A sharded dataset (shards.py) as one token stream with train and validation samples.

`ShardedTokens` reads sample windows with positioned reads (`os.pread`) from the shard files
that a `ShardStore` provides, never memory-mapping them: the loader's memory is its batches and
a bounded set of open files, whatever the dataset's size. The train/validation split is the
single-file one (dataset.py) over the stream of all shards, with every range cut at the shard
edges, so no sample spans two shards.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from distrain.data.corpus import DataError
from distrain.data.dataset import Ranges, TokenDataset, split_tokens
from distrain.data.documents import DocumentIndex
from distrain.data.shard_store import ShardStore

MAX_OPEN_SHARDS = 64


class ShardedTokens:
    """The concatenation of a store's shards, read window by window."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.index = store.index
        self.dtype = np.dtype(self.index.dtype)
        sizes = [s.num_tokens for s in self.index.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._open: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def shard_of(self, starts: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.shard_starts, starts, side="right") - 1

    def _fd(self, k: int) -> int:
        with self._lock:
            fd = self._open.get(k)
            if fd is not None:
                self._open.move_to_end(k)
                return fd
        shard = self.index.shards[k]
        try:
            fd = os.open(self.store.local_path(shard), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if self.store.local:
                raise
            self.store.forget(shard)  # evicted by another process sharing the cache
            fd = os.open(self.store.local_path(shard), os.O_RDONLY | os.O_NOFOLLOW)
        with self._lock:
            if k in self._open:  # another thread opened it meanwhile
                os.close(fd)
                return self._open[k]
            self._open[k] = fd
            while len(self._open) > MAX_OPEN_SHARDS:
                os.close(self._open.popitem(last=False)[1])
        return fd

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [len(starts), length]: the tokens from each stream position in `starts`; a
        window lies inside one shard (the split guarantees it)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        itemsize = self.dtype.itemsize
        for row, (start, k) in enumerate(
            zip(starts.tolist(), self.shard_of(starts).tolist(), strict=True)
        ):
            offset = (start - int(self.shard_starts[k])) * itemsize
            raw = os.pread(self._fd(k), length * itemsize, offset)
            out[row] = np.frombuffer(raw, dtype=self.dtype)
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()
        self.store.close()


def cut_at_shards(ranges: Ranges, shard_starts: np.ndarray) -> Ranges:
    """`ranges` with each range split where a shard begins inside it."""
    out: Ranges = []
    for start, end in ranges:
        inner = shard_starts[(shard_starts > start) & (shard_starts < end)].tolist()
        edges = [start, *inner, end]
        out += list(zip(edges[:-1], edges[1:], strict=False))
    return out


def shard_samples(dataset: TokenDataset, tokens: ShardedTokens) -> np.ndarray:
    """[num_shards, 2]: each shard's first sample index in `dataset` and its sample count
    (ranges, and so samples, come in stream order)."""
    range_shard = tokens.shard_of(dataset._range_starts)
    num_shards = len(tokens.index.shards)
    counts = np.bincount(range_shard, weights=np.diff(dataset._offsets), minlength=num_shards)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.stack([first, counts]).T.astype(np.int64)


def sharded_datasets(
    tokens: ShardedTokens,
    seq_len: int,
    val_fraction: float,
    *,
    where: str,
    documents: DocumentIndex | None = None,
) -> tuple[TokenDataset, TokenDataset]:
    train_ranges, val_ranges = split_tokens(tokens, val_fraction)
    train, val = (
        TokenDataset(tokens, cut_at_shards(r, tokens.shard_starts), seq_len, documents=documents)
        for r in (train_ranges, val_ranges)
    )
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"{where}: {len(tokens)} tokens give {len(train)} train and {len(val)} validation "
            f"samples of {seq_len + 1} tokens; use more data, a smaller training.seq_len or "
            "another data.val_fraction"
        )
    return train, val
