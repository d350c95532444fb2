"""Ring attention (parallel/ring_attention.py) against the unsplit causal attention, forward
and gradients: the ring's steps simulated in one process (each rank's plans and the order in
which blocks visit it), then the real kernel on 3 gloo ranks (every send goes to a neighbour
that is not the one it receives from). The training-loop proof is the cp2_ring parity row of
tests/test_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import process_group
from test_context import full_attention_reference

from distrain.parallel.attention_blocks import backward_blocks, forward_blocks, local_positions
from distrain.parallel.ring_attention import RingAttention, ring_plan

CPU = torch.device("cpu")


def _shard(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return x[:, :, local_positions(x.shape[2], rank, size, CPU)]


@pytest.mark.parametrize(
    ("size", "block"),
    [(2, 512), (2, 3), (4, 4)],
    ids=["one_block", "blocks_within_chunks", "four_ranks"],
)
def test_ring_steps_equal_full_causal_attention(size, block):
    (q, k, v), reference, weights, want = full_attention_reference(size)
    seq, chunk = q.shape[2], q.shape[2] // (2 * size)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(size):
        q_local, q_pos = _shard(q, rank, size), local_positions(seq, rank, size, CPU)
        out = torch.zeros_like(q_local)
        lse = torch.full(q_local.shape[:-1], float("-inf"), dtype=q.dtype)
        visits = [(rank - step) % size for step in range(size)]
        for source in visits:
            forward_blocks(
                q_local,
                _shard(k, source, size),
                _shard(v, source, size),
                q_pos,
                local_positions(seq, source, size, CPU),
                ring_plan(rank, source, size, chunk, block),
                out,
                lse,
            )
        rows = local_positions(seq, rank, size, CPU)
        torch.testing.assert_close(out, reference[:, :, rows], rtol=1e-12, atol=1e-12)
        grad_out = weights[:, :, rows]
        delta = (grad_out * out).sum(-1)
        dq_local = torch.zeros_like(q_local)
        for source in visits:
            columns = local_positions(seq, source, size, CPU)
            dk_block, dv_block = torch.zeros_like(q_local), torch.zeros_like(q_local)
            backward_blocks(
                q_local,
                _shard(k, source, size),
                _shard(v, source, size),
                q_pos,
                columns,
                ring_plan(rank, source, size, chunk, block),
                grad_out,
                lse,
                delta,
                (dq_local, dk_block, dv_block),
            )
            dk[:, :, columns] += dk_block
            dv[:, :, columns] += dv_block
        dq[:, :, rows] = dq_local
    for got, expected in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_ring_skips_the_key_chunks_after_a_query_chunk():
    """Rank 0 of 2 holds chunks 0 and 3: against rank 1's chunks 1 and 2 only its chunk 3 has
    work (chunk 0 precedes both), and no block is masked."""
    plan = ring_plan(0, 1, 2, chunk=4, block=512)
    assert plan == [(4, 8, 0, 4, False), (4, 8, 4, 8, False)]
    # Against its own chunks: chunk 0 x 0 and chunk 3 x 3 on the diagonal (masked), 3 x 0 whole.
    assert ring_plan(0, 0, 2, chunk=4, block=512) == [
        (0, 4, 0, 4, True),
        (4, 8, 0, 4, False),
        (4, 8, 4, 8, True),
    ]


def _ring_worker(rank: int, size: int, store_file: Path) -> None:
    with process_group(rank, size, store_file=store_file):
        (q, k, v), reference, weights, want = full_attention_reference(size)
        rows = local_positions(q.shape[2], rank, size, CPU)
        attend = RingAttention(dist.group.WORLD, rank, size, block=5)
        for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
            local = [_shard(t, rank, size).to(dtype).requires_grad_() for t in (q, k, v)]
            out = attend(*local)
            (out * weights[:, :, rows].to(dtype)).sum().backward()
            torch.testing.assert_close(out.double(), reference[:, :, rows], rtol=tol, atol=tol)
            for tensor, expected in zip(local, want, strict=True):
                torch.testing.assert_close(
                    tensor.grad.double(), expected[:, :, rows], rtol=tol, atol=tol
                )


@pytest.mark.slow
def test_ring_kernel_on_three_ranks_equals_full_causal_attention(tmp_path):
    """Every rank's output and the gradients of its q, k and v (k and v: summed over every
    rank that used them, delivered by the ring) equal the unsplit kernel's rows: float64 to
    rounding, bf16 inputs to bf16 rounding (the math runs in fp32, the travelling gradients
    too)."""
    mp.spawn(_ring_worker, args=(3, tmp_path / "store"), nprocs=3, join=True)
