"""Ring attention: context parallelism whose keys and values travel around the cp ranks.

The all-gather kernel (parallel/context.py) gives every rank the whole sequence's keys and values
and keeps them for backward. Here (`parallel.cp_method = "ring"`) a rank only ever holds its own
two chunks' keys and values and the block in flight: in forward, at step s of cp steps, cp rank r
computes its queries against the keys and values of rank (r - s) mod cp while already passing
them on to rank r + 1 and receiving the next ones from rank r - 1 (the exchange overlaps the
compute); blocks wholly after a query chunk are skipped, the diagonal ones masked, and each step
merged into the output through the running log-sum-exp, as in the all-gather kernel. What a layer
keeps for backward is this rank's q, k, v, output and log-sum-exp: 1/cp of the sequence, where
the all-gather kernel keeps the whole sequence's keys and values.

Backward sends the keys and values around the ring once more (nothing of the forward's ring is
kept); the gradient of each visiting key/value block is added to by every rank it passes and
travels with it, arriving back at its owner after the cp-th hop. The travelling gradient is kept
in fp32, so bf16 runs add up their ranks' shares at full precision. Per layer each rank sends
2 (cp - 1) key/value blocks in forward, and 2 (cp - 1) + 2 cp blocks in backward (the keys and
values, then their gradients): the same bytes as the all-gather and reduce-scatter, but as
point-to-point sends to one neighbour that can run behind the compute.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from distrain.parallel.attention_blocks import (
    BLOCK,
    Block,
    Documents,
    backward_blocks,
    chunk_order,
    forward_blocks,
    local_positions,
    work_dtype,
)


def ring_plan(q_rank: int, k_rank: int, size: int, chunk: int, block: int) -> list[Block]:
    """The score blocks of cp rank `q_rank`'s queries (its two chunks) against the two chunks
    of keys held by cp rank `k_rank`: a key chunk after a query chunk is skipped, one before it
    is seen whole, the same chunk masked on its diagonal blocks only. Integers only."""
    plan = []
    for q_slot, q_index in enumerate(chunk_order(q_rank, size)):
        for k_slot, k_index in enumerate(chunk_order(k_rank, size)):
            if k_index > q_index:
                continue
            for start in range(0, chunk, block):
                stop = min(start + block, chunk)
                keys_end = chunk if k_index < q_index else stop
                for ks in range(0, keys_end, block):
                    ke = min(ks + block, keys_end)
                    masked = k_index == q_index and ke - 1 > start
                    plan.append(
                        (
                            q_slot * chunk + start,
                            q_slot * chunk + stop,
                            k_slot * chunk + ks,
                            k_slot * chunk + ke,
                            masked,
                        )
                    )
    return plan


# Key/value gradients travel under their own tag: a gradient hop may still be in flight when
# the next key/value hop to the same neighbour starts.
GRAD_TAG = 1


class Ring:
    """Pass a tensor to the next cp rank while receiving the previous one's."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next, self.prev = (rank + 1) % size, (rank - 1) % size

    def start(self, tensor: torch.Tensor, *, tag: int = 0) -> tuple[torch.Tensor, list[dist.Work]]:
        """Begin sending `tensor` to rank + 1 and receiving rank - 1's into a new buffer; the
        buffer is valid once every returned work is waited on. Exchanges of one tag are matched
        in the order they start on every rank."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, group=self.group, group_peer=self.next, tag=tag),
                dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.prev, tag=tag),
            ]
        )
        return received, works

    @staticmethod
    def wait(works: list[dist.Work]) -> None:
        for work in works:
            work.wait()

    def visits(
        self, kv: torch.Tensor, work: torch.dtype, chunk: int, block: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Block]]]:
        """For each of the cp steps: the keys and values held (`kv` [2, B, H, 2c, D] of this
        rank first, then of rank - 1, ...), in the `work` dtype, their global positions, and the
        score blocks of this rank's queries against them. The next rank's keys and values are
        on their way while the caller computes with the ones yielded."""
        seq_len = 2 * chunk * self.size
        for step in range(self.size):
            source = (self.rank - step) % self.size
            passing = step < self.size - 1
            if passing:
                incoming, works = self.start(kv)
            held = kv.to(work)
            yield (
                held[0],
                held[1],
                local_positions(seq_len, source, self.size, kv.device),
                ring_plan(self.rank, source, self.size, chunk, block),
            )
            if passing:
                self.wait(works)
                kv = incoming


class _RingCausalAttention(torch.autograd.Function):
    """Exact causal attention of this cp rank's queries [B, H, 2c, D] over the whole sequence,
    the keys and values [B, H, 2c, D] of every cp rank visiting in turn (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, block: int, documents):
        dtype, work = q.dtype, work_dtype(q.dtype)
        chunk = q.shape[2] // 2
        q_pos = local_positions(2 * chunk * ring.size, ring.rank, ring.size, q.device)
        qw = q.to(work)
        out = torch.zeros_like(qw)
        lse = torch.full(qw.shape[:-1], float("-inf"), device=q.device, dtype=work)
        # Keys and values travel in the input dtype (a bf16 run sends half the bytes).
        for k_held, v_held, k_pos, plan in ring.visits(torch.stack([k, v]), work, chunk, block):
            doc_pair = _documents(documents, q_pos, k_pos)
            forward_blocks(qw, k_held, v_held, q_pos, k_pos, plan, out, lse, doc_pair)
        ctx.save_for_backward(q, k, v, out, lse, q_pos)
        ctx.ring, ctx.block, ctx.documents = ring, block, documents
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_pos = ctx.saved_tensors
        ring, block, documents = ctx.ring, ctx.block, ctx.documents
        dtype, work, chunk = q.dtype, out.dtype, q.shape[2] // 2
        qw, grad_out = q.to(work), grad_out.to(work)
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros_like(qw)
        arriving = None
        for k_held, v_held, k_pos, plan in ring.visits(torch.stack([k, v]), work, chunk, block):
            # This rank's share of the held block's gradient, computed while the share of the
            # ranks before it is still on its way here.
            dkv = torch.zeros((2, *k_held.shape), dtype=work, device=k_held.device)
            backward_blocks(
                qw,
                k_held,
                v_held,
                q_pos,
                k_pos,
                plan,
                grad_out,
                lse,
                delta,
                (dq, dkv[0], dkv[1]),
                _documents(documents, q_pos, k_pos),
            )
            if arriving is not None:
                ring.wait(arriving[1])
                dkv += arriving[0]
            # The gradient follows its block to the next rank; the last step's hop takes it
            # back to the block's owner.
            arriving = ring.start(dkv, tag=GRAD_TAG)
        ring.wait(arriving[1])
        dkv = arriving[0]
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None


def _documents(
    documents: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> Documents:
    """The document ids of this rank's queries and of the visiting keys, read from the whole
    sequence's ids by their global positions: the ids never travel around the ring."""
    return None if documents is None else (documents[:, q_pos], documents[:, k_pos])


class RingAttention:
    """The `attend` kernel of an Attention module on one cp rank, keys and values passed
    around the ring (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, *, block: int = BLOCK):
        self.ring, self.block = Ring(group, rank, size), block

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`documents` [B, T]: the whole sequence's document ids (see parallel/context.py)."""
        return _RingCausalAttention.apply(q, k, v, self.ring, self.block, documents)
