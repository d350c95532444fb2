"""Weighted mixtures of data sources: which source supplies each position of the global stream.

Global sample g comes from the source that a counter-based hash of (seed, g) picks with the
normalised weights (`choose`): a pure function of the seed, the position and the weights, the same
on every rank and for any number of ranks or workers, so a rank computes the choices of a whole
global batch by itself and no choice is ever replayed. Each source keeps its own position: the
count of samples it has supplied, which is also where its own sample order (order.py) continues.
A single source is the plain stream: every position its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distrain.data.dataset import TokenDataset
from distrain.data.order import Permutation, ShardWindows
from distrain.data.shard_store import ShardStore

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniform(seed: int, positions: np.ndarray) -> np.ndarray:
    """A uniform float in [0, 1) per position, from (seed, position) alone."""
    key = _splitmix64(np.array([seed], dtype=np.uint64))
    bits = _splitmix64(positions.astype(np.uint64) ^ key)
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def salt(name: str) -> int:
    """A source's own stream key in a mixture, so that sources of equal size differ in order."""
    return zlib.crc32(name.encode())


@dataclass(eq=False)
class Source:
    name: str
    weight: float
    dataset: TokenDataset
    order: Permutation | ShardWindows
    store: ShardStore | None = None
    """The shard store of a sharded source: told which shards are read now and next."""

    def __len__(self) -> int:
        return len(self.order)

    def want_from(self, position: int) -> None:
        if self.store is not None:
            names = [self.store.index.shards[k].name for k in self.order.shards_from(position)]
            self.store.want(names)


class Mixture:
    def __init__(self, sources: Sequence[Source], *, seed: int) -> None:
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.sources = list(sources)
        self.seed = seed
        total = sum(s.weight for s in self.sources)
        self.weights = np.array([s.weight / total for s in self.sources])
        self._edges = np.cumsum(self.weights)
        self._edges[-1] = 1.0

    @classmethod
    def single(cls, dataset: TokenDataset, *, seed: int, name: str = "train") -> Mixture:
        return cls([Source(name, 1.0, dataset, Permutation(len(dataset), seed=seed))], seed=seed)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def choose(self, start: int, stop: int) -> np.ndarray:
        """The source of each global position in [start, stop)."""
        if len(self.sources) == 1:
            return np.zeros(stop - start, dtype=np.int64)
        u = uniform(self.seed, np.arange(start, stop, dtype=np.int64))
        return np.searchsorted(self._edges, u, side="right").astype(np.int64)
