"""The block math both context-parallel attention kernels share: which two chunks of a
sequence a cp rank holds (one early, its mirror late, so causal work is balanced), the global
positions of its tokens, and exact causal attention one score block at a time (the online softmax
of flash attention, forward and recomputing backward), optionally only within documents. The
all-gather kernel (parallel/context.py) runs it over the whole sequence's keys and values, the
ring kernel (parallel/ring_attention.py) over one visiting rank's at a time; nothing here
communicates.
"""

from __future__ import annotations

import torch

from distrain.torch_compat import is_fake


def chunk_order(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 x size) cp rank `rank` holds: one early, its mirror late."""
    return rank, 2 * size - 1 - rank


def local_positions(seq_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    """Global positions [seq_len / size] of rank `rank`'s tokens, in the order it holds them."""
    chunk = seq_len // (2 * size)
    return torch.cat(
        [torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in chunk_order(rank, size)]
    )


# Query rows and keys per block of the blockwise attention: bounds the score block a rank holds
# at any moment to BLOCK x BLOCK per head, whatever the sequence length.
BLOCK = 512


Block = tuple[int, int, int, int, bool]
"""(first query row, end, first key, end, masked) of one score block: rows and keys are offsets
in the tensors a kernel holds; masked when some key lies after some query."""

Documents = tuple[torch.Tensor, torch.Tensor] | None
"""(document ids [B, queries] of the query rows, [B, keys] of the keys) a kernel holds, for
attention within documents only; None: one document."""


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    masked: bool,
    documents: Documents,
) -> torch.Tensor:
    """Scaled scores of a query block against a key block; -inf where a key lies after a query
    (only blocks that straddle the diagonal need the mask) or, with `documents` (the block's
    ids), in another document. Every block is computed: which ones hold no pair of one document
    is a device value, and skipping them would cost a host sync."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if masked:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    if documents is not None:
        q_doc, k_doc = documents
        scores = scores.masked_fill(q_doc[:, None, :, None] != k_doc[:, None, None, :], -torch.inf)
    return scores


def _block_documents(documents: Documents, qs: int, qe: int, ks: int, ke: int) -> Documents:
    if documents is None:
        return None
    return documents[0][:, qs:qe], documents[1][:, ks:ke]


def _blocks_to_run(plan: list[Block], q: torch.Tensor) -> list[Block]:
    """The blocks of `plan` to compute: all of them, or on fake tensors (the planner's fake
    build, which has no values to compute) the largest unmasked and the largest masked one.
    Each block makes its temporaries, frees them before the next, and updates the same
    tensors in place, so those two reach the peak of the whole plan (a 32k-token sequence has
    thousands of blocks a layer)."""
    if not is_fake(q):
        return plan
    largest: dict[bool, Block] = {}
    for block in plan:
        if block[4] not in largest or _area(block) > _area(largest[block[4]]):
            largest[block[4]] = block
    return list(largest.values())


def _area(block: Block) -> int:
    qs, qe, ks, ke, _ = block
    return (qe - qs) * (ke - ks)


def forward_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    plan: list[Block],
    out: torch.Tensor,
    lse: torch.Tensor,
    documents: Documents = None,
) -> None:
    """Merge the softmax of every block of `plan` into `out` and the running log-sum-exp `lse`
    of each query row (both updated in place; the online softmax of flash attention)."""
    scale = q.shape[-1] ** -0.5
    for qs, qe, ks, ke, masked in _blocks_to_run(plan, q):
        scores = _scores(
            q[:, :, qs:qe],
            k[:, :, ks:ke],
            q_pos[qs:qe],
            k_pos[ks:ke],
            scale,
            masked,
            _block_documents(documents, qs, qe, ks, ke),
        )
        merged = torch.logaddexp(lse[:, :, qs:qe], scores.logsumexp(-1))
        # A row that has seen no key of its document yet (only under document masking) keeps
        # -inf: subtracting 0 instead of -inf keeps its probabilities 0 rather than NaN.
        shift = merged.masked_fill(merged == -torch.inf, 0.0)
        probs = (scores - shift[..., None]).exp()
        keep = (lse[:, :, qs:qe] - shift).exp()[..., None]
        out[:, :, qs:qe] = out[:, :, qs:qe] * keep + probs @ v[:, :, ks:ke]
        lse[:, :, qs:qe] = merged
        # Freed before the next block makes its own (each is a block of scores per head).
        del scores, merged, shift, probs, keep


def backward_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    plan: list[Block],
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    documents: Documents = None,
) -> None:
    """Add every block's share of the gradients of q, k and v to `grads` (in place), each
    block's probabilities recomputed from the final log-sum-exp `lse`; `delta` is the row sum
    of grad_out x out."""
    dq, dk, dv = grads
    scale = q.shape[-1] ** -0.5
    for qs, qe, ks, ke, masked in _blocks_to_run(plan, q):
        go, qb, kb, vb = grad_out[:, :, qs:qe], q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke]
        block_documents = _block_documents(documents, qs, qe, ks, ke)
        scores = _scores(qb, kb, q_pos[qs:qe], k_pos[ks:ke], scale, masked, block_documents)
        # The final log-sum-exp of every row is finite: a query always sees itself.
        probs = (scores - lse[:, :, qs:qe, None]).exp()
        dv[:, :, ks:ke] += probs.transpose(-1, -2) @ go
        dscores = probs * (go @ vb.transpose(-1, -2) - delta[:, :, qs:qe, None])
        dq[:, :, qs:qe] += (dscores @ kb) * scale
        dk[:, :, ks:ke] += (dscores.transpose(-1, -2) @ qb) * scale
        del scores, probs, dscores


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention math runs in: half-precision inputs are upcast, since the softmax
    statistics need fp32's range."""
    return torch.promote_types(dtype, torch.float32)
