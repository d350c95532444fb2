"""Sample orders: which sample of a source sits at each position of its endless stream.

An order is a pure function of the source's sample layout, the seed and the position, so any
rank can look up any position directly (a resume jumps there in O(1)) and no rank, worker or node
count enters it. Epoch e covers positions [e*N, (e+1)*N) and visits each of the N samples once.

`Permutation`: epoch e is `default_rng([seed, e]).permutation(N)` (`[seed, salt, e]` in a
mixture), the single-file order.

`ShardWindows`, the sharded order: epoch e shuffles the shards, cuts the shuffled list into
windows of `window` consecutive shards and visits the windows in turn, each window's samples in
a permutation of their own. Only one window's shards are read at a time (and the next one's
fetched), so a bounded cache serves any dataset size, and each permutation is of one window's
samples, never of the whole dataset.
"""

from __future__ import annotations

import numpy as np

_CACHED_PERMUTATIONS = 4


class Permutation:
    def __init__(self, num_samples: int, *, seed: int, salt: int | None = None) -> None:
        self.num_samples, self.key = num_samples, [seed] if salt is None else [seed, salt]
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([*self.key, epoch])
            self._perms[epoch] = rng.permutation(self.num_samples)
        return self._perms[epoch]

    def samples(self, positions: np.ndarray) -> np.ndarray:
        epoch, offset = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for e in np.unique(epoch).tolist():
            here = epoch == e
            out[here] = self._perm(e)[offset[here]]
        return out

    def shards_from(self, position: int) -> list[int]:
        return []


class ShardWindows:
    """`shard_samples[k]` = (first sample index, sample count) of shard k; see the module doc."""

    def __init__(
        self,
        shard_samples: np.ndarray,
        *,
        seed: int,
        window: int,
        salt: int | None = None,
    ) -> None:
        self.first = np.asarray(shard_samples[:, 0], dtype=np.int64)
        self.count = np.asarray(shard_samples[:, 1], dtype=np.int64)
        self.num_samples = int(self.count.sum())
        self.window, self.key = window, [seed] if salt is None else [seed, salt]
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the shards in this epoch's order, each window's first position in the epoch)."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            shards = np.random.default_rng([*self.key, epoch]).permutation(self.count.size)
            sizes = self.count[shards]
            per_window = np.add.reduceat(sizes, np.arange(0, shards.size, self.window))
            self._epochs[epoch] = (shards, np.concatenate([[0], np.cumsum(per_window)]))
        return self._epochs[epoch]

    def _window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(window w's sample indices in shard order, its permutation)."""
        key = (epoch, w)
        if key not in self._windows:
            if len(self._windows) >= _CACHED_PERMUTATIONS:
                self._windows.pop(next(iter(self._windows)))
            shards, _ = self._epoch(epoch)
            members = shards[w * self.window : (w + 1) * self.window]
            samples = np.concatenate(
                [np.arange(self.first[k], self.first[k] + self.count[k]) for k in members]
            )
            perm = np.random.default_rng([*self.key, epoch, w]).permutation(samples.size)
            self._windows[key] = (samples, perm)
        return self._windows[key]

    def samples(self, positions: np.ndarray) -> np.ndarray:
        epoch, offset = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for e in np.unique(epoch).tolist():
            here = np.flatnonzero(epoch == e)
            _, starts = self._epoch(e)
            w_of = np.searchsorted(starts, offset[here], side="right") - 1
            for w in np.unique(w_of).tolist():
                sel = here[w_of == w]
                samples, perm = self._window(e, w)
                out[sel] = samples[perm[offset[sel] - starts[w]]]
        return out

    def shards_from(self, position: int) -> list[int]:
        """The shards of the window holding `position`, then those of the next window."""
        epoch, offset = divmod(position, self.num_samples)
        shards, starts = self._epoch(epoch)
        w = int(np.searchsorted(starts, offset, side="right") - 1)
        current = shards[w * self.window : (w + 1) * self.window]
        if w + 1 < starts.size - 1:
            following = shards[(w + 1) * self.window : (w + 2) * self.window]
        else:
            following = self._epoch(epoch + 1)[0][: self.window]
        return current.tolist() + following.tolist()
