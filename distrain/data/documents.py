"""Document boundaries of a packed token stream, and what a sample learns from them.

A sample is a window of the token stream, and may hold the end of one document and the start of
the next. With data.document_masking each window gets document ids (0 for the document it starts
in, +1 at every boundary inside it): the model's attention then never crosses a boundary, and the
first token of a document is no target (nothing of its document precedes it), so the targets of a
packed sample are those of its documents each run alone. Boundaries come from a prepared token
file's DATA.bin.docs.npy, or, for data without one, from the end-of-document token data.eos_id
(the token ending each document).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from distrain.config.schema import DataConfig
from distrain.data.corpus import DataError, is_token_data
from distrain.data.tokfile import docs_path

IGNORE_INDEX = -100
"""A target that is not predicted: torch's cross_entropy skips it (its default ignore_index)."""


class DocumentIndex:
    """Where documents start: sorted `boundaries` (document i is tokens [boundaries[i],
    boundaries[i + 1])), or else the end-of-document token `eos_id` (the token after one
    starts a new document)."""

    def __init__(self, *, boundaries: np.ndarray | None = None, eos_id: int | None = None):
        if (boundaries is None) == (eos_id is None):
            raise ValueError("a DocumentIndex takes boundaries or an eos_id, one of them")
        self.boundaries = boundaries
        self.eos_id = eos_id

    def window_ids(self, starts: np.ndarray, windows: np.ndarray) -> np.ndarray:
        """Document ids [B, W] of the token windows [B, W] that begin at stream offsets `starts`
        [B]: 0 for the document of each window's first token, +1 at each boundary after it."""
        if self.boundaries is not None:
            offsets = starts[:, None] + np.arange(windows.shape[1], dtype=np.int64)
            ids = np.searchsorted(self.boundaries, offsets, side="right")
            return ids - ids[:, :1]
        ends = windows[:, :-1] == self.eos_id
        return np.concatenate(
            [np.zeros((len(windows), 1), np.int64), np.cumsum(ends, axis=1, dtype=np.int64)],
            axis=1,
        )


def packed_sample(windows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """(inputs, targets, documents) [B, T] of windows [B, T + 1] with their document ids: a
    target in another document than its input (a document's first token) is IGNORE_INDEX."""
    targets = windows[:, 1:].copy()
    targets[ids[:, 1:] != ids[:, :-1]] = IGNORE_INDEX
    return windows[:, :-1], targets, ids[:, :-1]


def drop_uncounted(targets: np.ndarray, counted: np.ndarray) -> None:
    """Make the targets [B, T] whose token does not count for the loss IGNORE_INDEX, in place:
    `counted` [B, T + 1] is the windows' loss mask (a conversation's: 0 off the assistant's
    answers), so target t, token t + 1 of its window, counts where counted[:, t + 1] does."""
    targets[counted[:, 1:] == 0] = IGNORE_INDEX


def boundaries_file(cfg: DataConfig) -> Path | None:
    """The DATA.bin.docs.npy beside a token-file data.path, None when there is none."""
    if not is_token_data(cfg):
        return None
    path = docs_path(Path(cfg.path))
    return path if path.is_file() else None


def no_boundaries_message(cfg: DataConfig) -> str:
    return (
        f"data.document_masking: data.path {cfg.path!r} has no document boundaries file "
        "(DATA.bin.docs.npy, which `distrain prepare` writes); set data.eos_id to the token "
        "that ends each document, or data.document_masking = false"
    )


def document_index(cfg: DataConfig, num_tokens: int) -> DocumentIndex:
    """The document boundaries of the configured corpus (of `num_tokens` tokens) for
    data.document_masking: a prepared file's DATA.bin.docs.npy, else data.eos_id."""
    path = boundaries_file(cfg)
    if path is not None:
        # Data, never code: a plain int64 array, no pickled objects.
        boundaries = np.load(path, mmap_mode="r", allow_pickle=False)
        if (
            boundaries.ndim != 1
            or not np.issubdtype(boundaries.dtype, np.integer)
            or boundaries.size < 2
            or boundaries[0] != 0
            or boundaries[-1] != num_tokens
            or np.any(np.diff(boundaries) < 0)
        ):
            raise DataError(
                f"data.document_masking: {str(path)!r} holds no increasing document "
                f"boundaries from 0 to the {num_tokens} tokens of data.path; prepare the "
                "data again"
            )
        return DocumentIndex(boundaries=np.asarray(boundaries, dtype=np.int64))
    if cfg.eos_id is None:
        raise DataError(no_boundaries_message(cfg))
    return DocumentIndex(eos_id=cfg.eos_id)
