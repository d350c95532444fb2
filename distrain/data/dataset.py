"""Train/validation split of a token stream, fixed-length samples drawn from each split, and the
named validation sets of data.eval_sets (each read whole).

Splits are lists of (start, end) token ranges into the one corpus array, so a memory-mapped token
file is never copied: samples are sliced out of it by index when a batch is built. The tokens are
an array, or a sharded dataset's stream (sharded.py), which reads its windows itself. With
data.document_masking a batch also carries the samples' document ids (data/documents.py). A token
file of conversations has a loss mask (tokfile.py): the targets it does not count are
IGNORE_INDEX, which the loss and its divisor (the count of targets >= 0) skip on every layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distrain.config.schema import DataConfig
from distrain.data.corpus import DataError, is_sharded, is_token_data, read_corpus
from distrain.data.documents import DocumentIndex, document_index, drop_uncounted, packed_sample
from distrain.data.tokfile import read_loss_mask, read_sidecar

Ranges = list[tuple[int, int]]
Batch = tuple[torch.Tensor, ...]
"""(inputs, targets), or (inputs, targets, documents) with the samples' document ids, [B, T]:
what the loader hands the step and the model runs."""


def split_tokens(
    tokens: Sized, val_fraction: float, *, block_tokens: int = 1 << 16
) -> tuple[Ranges, Ranges]:
    """Deterministic (train_ranges, val_ranges): cut the stream into blocks of `block_tokens` and
    send an evenly spread `val_fraction` of them to validation (block i is val iff
    floor((i+1)*f) > floor(i*f)). Blocks, rather than a random sample of windows, keep validation
    text unseen in training; even spreading samples every part of the corpus. Fixed-size blocks
    keep the split of a corpus prefix consistent with the split of the whole corpus.

    Corpora shorter than ceil(1/f) blocks get smaller blocks so that both splits receive data.
    Adjacent blocks of one split are merged into a single range (fewer windows lost at edges).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    n = len(tokens)
    if n == 0:
        return [], []
    min_blocks = max(2, math.ceil(1.0 / val_fraction))
    block = max(1, min(block_tokens, math.ceil(n / min_blocks)))
    num_blocks = math.ceil(n / block)
    i = np.arange(num_blocks)
    is_val = np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction)
    if num_blocks >= 2 and not is_val.any():
        is_val[-1] = True
    splits: tuple[Ranges, Ranges] = ([], [])
    for b in range(num_blocks):
        ranges = splits[int(is_val[b])]
        start, end = b * block, min((b + 1) * block, n)
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return splits


class TokenDataset:
    """Non-overlapping windows of seq_len + 1 tokens (stride seq_len) inside each range: the model
    reads window[:-1] and predicts window[1:], so each token is a target exactly once."""

    def __init__(
        self,
        tokens: Any,
        ranges: Ranges,
        seq_len: int,
        *,
        documents: DocumentIndex | None = None,
        loss_mask: np.ndarray | None = None,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"training.seq_len must be > 0, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.documents = documents
        self.loss_mask = loss_mask
        """One uint8 a token (1: it counts for the loss), None when every token counts."""
        counts = [max(0, (end - start - 1) // seq_len) for start, end in ranges]
        self._range_starts = np.array([start for start, _ in ranges], dtype=np.int64)
        # _offsets[r] is the index of range r's first sample; empty ranges repeat an offset.
        self._offsets = np.cumsum([0, *counts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _window_starts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)}): {indices}")
        r = np.searchsorted(self._offsets, idx, side="right") - 1
        return self._range_starts[r] + (idx - self._offsets[r]) * self.seq_len

    def windows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """int64 [len(indices), seq_len + 1]: the samples' token windows, in numpy only (no
        torch op, so a loader thread does not share torch's intra-op threads with the step)."""
        return self._windows(self._window_starts(indices))

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        if not isinstance(self.tokens, np.ndarray):
            return self.tokens.windows(starts, self.seq_len + 1)
        offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        return np.asarray(self.tokens[starts[:, None] + offsets], np.int64)

    def counted(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """uint8 [len(indices), seq_len + 1]: the loss mask of the samples' windows."""
        assert self.loss_mask is not None
        starts = self._window_starts(indices)
        offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        return np.asarray(self.loss_mask[starts[:, None] + offsets], np.uint8)

    def __getitem__(self, index: int) -> np.ndarray:
        return self._windows(self._window_starts([index]))[0]

    def document_ids(self, indices: Sequence[int] | np.ndarray, windows: np.ndarray) -> np.ndarray:
        """Document ids [B, seq_len + 1] of the samples' `windows` (numpy only, as windows)."""
        assert self.documents is not None
        return self.documents.window_ids(self._window_starts(indices), windows)

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """(inputs, targets), each a LongTensor [len(indices), seq_len], gathered in one read;
        with document ids (inputs, targets, documents)."""
        windows = self.windows(indices)
        if self.documents is not None:
            parts = packed_sample(windows, self.document_ids(indices, windows))
        else:
            parts = (windows[:, :-1], windows[:, 1:].copy())
        if self.loss_mask is not None:
            drop_uncounted(parts[1], self.counted(indices))
        return tuple(torch.from_numpy(np.ascontiguousarray(p)) for p in parts)


def loss_mask_of(cfg: DataConfig, path: str, field: str = "data.path") -> np.ndarray | None:
    """The loss mask of the prepared token file `path` (conversations), None when it has none.
    Conversations need data.document_masking: packed ones must not attend to each other."""
    if path == "" or is_sharded(path) or not Path(path).is_file():
        return None
    mask = read_loss_mask(Path(path), read_sidecar(Path(path)))
    if mask is not None and not cfg.document_masking:
        raise DataError(
            f"{field} {path!r} holds conversations (a loss mask from `distrain prepare`); set "
            "data.document_masking = true, so that the conversations packed into a sequence do "
            "not attend to each other"
        )
    return mask


def build_datasets(
    cfg: DataConfig, seq_len: int, *, vocab_size: int | None = None, documents: bool = True
) -> tuple[TokenDataset, TokenDataset]:
    """(train, val) datasets of the configured corpus; both must hold at least one sample, and
    with `vocab_size` every token id must be below it. `documents` False: without document ids
    (for counting samples)."""
    tokens = read_corpus(cfg, vocab_size=vocab_size)
    index = document_index(cfg, len(tokens)) if cfg.document_masking and documents else None
    mask = loss_mask_of(cfg, cfg.path) if is_token_data(cfg) else None
    train_ranges, val_ranges = split_tokens(tokens, cfg.val_fraction)
    train = TokenDataset(tokens, train_ranges, seq_len, documents=index, loss_mask=mask)
    val = TokenDataset(tokens, val_ranges, seq_len, documents=index, loss_mask=mask)
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"corpus too small for seq_len {seq_len}: {len(tokens)} tokens give {len(train)} "
            f"train and {len(val)} validation samples of {seq_len + 1} tokens; use more data "
            "(data.path, data.max_bytes), a smaller training.seq_len or another data.val_fraction"
        )
    return train, val


def check_split(cfg: DataConfig, seq_len: int, global_batch_size: int) -> None:
    """Before any worker starts: the corpus of data.path (one file or folder, read as the
    workers read it; token files are memory-mapped) splits into samples for validation and at
    least one global batch for training (`build_datasets`' and the loader's refusals, raised
    here instead of in every worker)."""
    train, _ = build_datasets(cfg, seq_len, documents=False)
    if len(train) < global_batch_size:
        raise too_small_for_a_batch(len(train), seq_len, global_batch_size)


def too_small_for_a_batch(
    samples: int, seq_len: int, global_batch_size: int, of: str = ""
) -> DataError:
    """The refusal of a training split (`of`: which source's) of fewer `samples` than one global
    batch needs."""
    return DataError(
        f"the data set is too small: the training split{of} holds {samples} sequences of "
        f"{seq_len} tokens, one global batch needs {global_batch_size} "
        "(training.global_batch_size); use more data (data.path, data.max_bytes), a smaller "
        "training.global_batch_size or a shorter training.seq_len"
    )


def build_eval_sets(
    cfg: DataConfig, seq_len: int, *, vocab_size: int | None = None
) -> dict[str, TokenDataset]:
    """name -> dataset of every data.eval_sets entry, in order: its whole token stream in
    windows of seq_len + 1, read with the run's tokenizer and token dtype."""
    sets = {}
    for e in cfg.eval_sets:
        source = dataclasses.replace(
            cfg, path=e.path, format=e.format, glob=e.glob, max_bytes=e.max_bytes, eval_sets=()
        )
        try:
            tokens = read_corpus(source, vocab_size=vocab_size)
        except DataError as err:
            raise DataError(f"data.eval_sets {e.name!r}: {err}") from None
        dataset = TokenDataset(tokens, [(0, len(tokens))], seq_len)
        if len(dataset) == 0:
            raise DataError(
                f"data.eval_sets {e.name!r}: {len(tokens)} tokens in {e.path!r} give no sample "
                f"of {seq_len + 1} tokens; give it more text or use a shorter training.seq_len"
            )
        sets[e.name] = dataset
    return sets
