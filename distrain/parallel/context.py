"""Context parallelism: each sequence split across the ranks of the `cp` mesh axis.

Split: a sequence of T tokens is cut into 2 x cp chunks of c = T / (2 cp); cp rank r holds chunk
r and chunk 2cp-1-r. Under a causal mask a late chunk attends to more keys than an early one, so
pairing the i-th earliest with the i-th latest gives every rank the same attention work
(torchtitan and Megatron balance the load the same way). Rank r's tokens keep their global
positions (rotary tables and learned embeddings are indexed by them) and the targets are split
the same way, so each rank's mean loss is over an equal share of the tokens: the mean over the
cp group (and the data-parallel ranks) is the loss of the whole batch.

Attention: every rank all-gathers the keys and values of its cp group (an autograd Function
whose backward reduce-scatters their gradients back to the ranks that own them) and puts the
chunks in sequence order: the all-gather variant of context parallelism (Llama 3 trains long
context this way; torch's own context parallelism defaults to it), exact. With
`parallel.cp_method = "ring"` the keys and values are passed around the cp ranks instead
(parallel/ring_attention.py; both kernels run parallel/attention_blocks.py's block math). Each rank
then computes causal attention for its own queries block by block, merging the blocks with a
running log-sum-exp (the online softmax) and recomputing them in backward, so no
[queries x keys] matrix or mask is ever held: what a layer keeps is linear in the sequence
length (the whole sequence's keys and values, and 1/cp of everything else: queries, MLP,
norms, logits).

Gradients: the data-parallel wrapper reduces them over dp x cp (mesh.py's gradient mesh), as
every cp rank computed its own share of the loss; so do the optimizers that communicate
(ZeRO-1's state shards, 1-bit Adam's momentum exchange) and DDP's communication hooks.

Pipeline stages: a schedule calls a stage with its input alone, so `apply_context_parallel`
gives each stage a hook that passes the global positions of this rank's columns.

Document masking: the kernels take the whole sequence's document ids [B, T] (every cp rank reads
the full batch before it keeps its columns, so no id travels) and index them by the global
positions of the queries and of the keys they hold.

torch 2.13's `torch.distributed.tensor.experimental.context_parallel` is not used: on CPU it
raises "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered" (its ring kernels cover the CUDA flash, efficient and cuDNN ops only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.parallel.attention_blocks import (
    BLOCK,
    Block,
    backward_blocks,
    chunk_order,
    forward_blocks,
    local_positions,
    work_dtype,
)
from distrain.parallel.ring_attention import RingAttention
from distrain.torch_compat import all_gather_single, reduce_scatter_single


def gathered_to_sequence(gathered: torch.Tensor, size: int) -> torch.Tensor:
    """[size, B, H, 2c, D] (each rank's two chunks, by rank) -> [B, H, T, D] in sequence order."""
    ranks, batch, heads, local, dim = gathered.shape
    chunks = gathered.view(ranks, batch, heads, 2, local // 2, dim)
    # (rank, slot) of each chunk of the sequence, as Python ints: no index tensor to copy to
    # the device in every layer.
    owner = [(0, 0)] * (2 * size)
    for r in range(size):
        early, late = chunk_order(r, size)
        owner[early], owner[late] = (r, 0), (r, 1)
    return torch.cat([chunks[r, :, :, slot] for r, slot in owner], dim=2)


def _plan(rank: int, size: int, chunk: int, block: int) -> list[Block]:
    """The score blocks of rank `rank`'s query rows (blocks never straddle its two chunks)
    against the whole sequence's keys: every key block up to a query block's last position,
    masked only where it reaches past the block's first position. From integers alone: no
    device value is read."""
    plan = []
    for slot, index in enumerate(chunk_order(rank, size)):
        for start in range(0, chunk, block):
            stop = min(start + block, chunk)
            first, last = index * chunk + start, index * chunk + stop - 1
            for ks in range(0, last + 1, block):
                ke = min(ks + block, last + 1)
                plan.append((slot * chunk + start, slot * chunk + stop, ks, ke, ke - 1 > first))
    return plan


class _BlockwiseCausalAttention(torch.autograd.Function):
    """Exact causal attention of queries at global positions `q_pos` (increasing within each
    block) over the whole sequence's keys/values, one BLOCK x BLOCK score block at a time.

    Forward keeps a running log-sum-exp per query row and merges each block's softmax into the
    output (the online softmax of flash attention); backward recomputes each block's
    probabilities from the saved log-sum-exp. What is kept for backward is q, k, v, the output
    and one log-sum-exp per row: linear in the sequence length, never a score matrix (SDPA with
    an explicit mask would save a [queries, keys] float mask per layer). Plain tensor ops, so the
    same code runs on every device; math in fp32 (or fp64) whatever the input dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos: torch.Tensor, plan: list[Block], documents):
        dtype = q.dtype
        work = work_dtype(dtype)
        q, k, v = q.to(work), k.to(work), v.to(work)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=work)
        k_pos = torch.arange(k.shape[2], device=q.device)
        doc_pair = None if documents is None else (documents[:, q_pos], documents)
        forward_blocks(q, k, v, q_pos, k_pos, plan, out, lse, doc_pair)
        ctx.save_for_backward(q, k, v, out, lse, q_pos)
        ctx.plan, ctx.dtype, ctx.doc_pair = plan, dtype, doc_pair
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_pos = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype)
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(-1)
        k_pos = torch.arange(k.shape[2], device=q.device)
        backward_blocks(q, k, v, q_pos, k_pos, ctx.plan, grad_out, lse, delta, grads, ctx.doc_pair)
        return *(g.to(ctx.dtype) for g in grads), None, None, None


def attend_local(
    q: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    rank: int,
    size: int,
    *,
    block: int = BLOCK,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of rank `rank`'s queries [B, H, 2c, D] (its two chunks) over the whole
    sequence's keys and values [B, H, T, D]; with the sequence's document ids [B, T] only
    within each query's document."""
    q_pos = local_positions(k_seq.shape[2], rank, size, q.device)
    plan = _plan(rank, size, q.shape[2] // 2, block)
    return _BlockwiseCausalAttention.apply(q, k_seq, v_seq, q_pos, plan, documents)


class _GatherChunks(torch.autograd.Function):
    """All-gather x [B, H, 2c, D] over `group` into [size, B, H, 2c, D]; backward sums each
    rank's gradient of the gathered tensor and hands every rank its own slice
    (reduce-scatter), since every rank's queries used every rank's keys."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        # The concatenated [size x B, ...] output: gloo accepts no stacked [size, B, ...] one.
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        local = grad.new_empty(grad.shape[1:])
        reduce_scatter_single(local, grad.contiguous().flatten(0, 1), group=ctx.group)
        return local, None


class ContextParallelAttention:
    """The `attend` kernel of an Attention module on one cp rank (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`documents` [B, T]: the whole sequence's document ids, which every cp rank holds
        (each reads the full batch before taking its columns), so none travel."""
        k_seq = gathered_to_sequence(_GatherChunks.apply(k, self.group), self.size)
        v_seq = gathered_to_sequence(_GatherChunks.apply(v, self.group), self.size)
        return attend_local(q, k_seq, v_seq, self.rank, self.size, documents=documents)


class SequenceSplit:
    """This rank's share of each batch: the token columns of its two chunks, and their global
    positions (passed to the model so rotary and learned positions stay those of the sequence)."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(seq_len, self.rank, self.size, device)

    def shard(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, positions) of this rank, from the full [B, T] batch."""
        positions = self.positions(inputs.shape[1], inputs.device)
        return inputs[:, positions], targets[:, positions], positions


def apply_context_parallel(
    model: nn.Module,
    attention: list[nn.Module],
    cp_mesh: DeviceMesh,
    method: str,
    *,
    stage_seq_len: int | None = None,
) -> None:
    """Give every attention module of `model` (`attention`, as its family's spec lists them:
    each calls its `attend` kernel on q, k, v [B, H, T, D]) the context-parallel kernel over
    `cp_mesh`: `method` (parallel.cp_method) "allgather", or "ring" (parallel/ring_attention.py).

    stage_seq_len: `model` is a pipeline stage of sequences of this many tokens. The schedule
    calls a stage with its input alone (tokens, or the previous stage's hidden states of this
    rank's columns, which under sequence parallelism are a further tp shard of them), so a
    forward pre-hook passes it the columns' global positions: the same for every microbatch."""
    kernel = RingAttention if method == "ring" else ContextParallelAttention
    attend = kernel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    for module in attention:
        module.attend = attend
    if stage_seq_len is not None:
        split = SequenceSplit(cp_mesh)

        def pass_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            positions = split.positions(stage_seq_len, args[0].device)
            return args, {**kwargs, "positions": positions}

        model.register_forward_pre_hook(pass_positions, with_kwargs=True)
