"""The decoder's parallel plans: Megatron-style tensor/sequence parallelism (`tensor_plan`), read by
parallel/tensor.py through the family's spec (spec.py), which also names what a pipeline stage
keeps and where checkpointing, compile and FSDP2 wrap.

The split (Megatron-LM): attention heads and the MLP's hidden units are divided over the ranks
(wq/wk/wv and w_up column-parallel, wo and w_down row-parallel), so each block costs one
all-reduce in forward and one in backward per sub-layer. The token embedding and the output head
are split over the vocabulary; the logits stay vocab-sharded (Shard(-1)) and the loss is computed
vocab-parallel, so no rank ever holds [B, T, vocab]. With SP the residual stream between
sub-layers is sharded over the sequence instead of replicated: norms then run on a 1/tp slice
and each all-reduce becomes a reduce-scatter + all-gather pair with the same traffic. Norm
weights and learned positions are replicated (`ReplicatedParallel`). A pipeline stage that lacks
the embedding, the final norm or the head is handled; its hidden-state input and output are then
this rank's sequence chunk under SP. A tied head shards the shared [vocab, dim] weight as
Shard(0), like the vocab-parallel embedding, so the two stay one weight.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from distrain.parallel.tensor import ReplicatedParallel


def _block_plan(
    sequence_parallel: bool, *, swiglu: bool, qk_norm: bool
) -> dict[str, ParallelStyle]:
    """Layouts for one Block's submodules, keyed by their names inside the block. Key/value
    heads split like query heads (layout/rules.py makes sure whole heads land on each rank)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=residual),
        "mlp.w_up": ColwiseParallel(),
        "mlp.w_down": RowwiseParallel(output_layouts=residual),
    }
    if swiglu:
        plan["mlp.w_gate"] = ColwiseParallel()
    if qk_norm:
        # Each rank's query and key heads [B, T, heads, D]: the norm's weight replicated, its
        # input sharded over the heads, so its gradient is summed over every rank's heads.
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        plan["attn_norm"] = plan["mlp_norm"] = ReplicatedParallel()
        return plan
    # Norms run on the sequence shard; attention and MLP need the whole sequence, gathered on
    # entry. `rope` (Attention's second input) is a plain full-length table: left alone.
    plan["attn_norm"] = plan["mlp_norm"] = SequenceParallel(use_local_output=True)
    plan["attn"] = PrepareModuleInput(
        input_layouts=(Shard(1), None),
        desired_input_layouts=(Replicate(), None),
        use_local_output=True,
    )
    plan["mlp"] = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    return plan


def tensor_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The styles of the decoder `model` (or one pipeline stage of it), by submodule path, in the
    order `parallelize_module` applies them (see the module docstring)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.pos_emb is not None:
        # Looked up for all T positions, then cut to this rank's sequence chunk under SP; the
        # backward all-gathers the chunks' gradients, so every rank updates every position.
        plan["pos_emb"] = ReplicatedParallel(output_layout=Shard(0) if sequence_parallel else None)
    for key, block in model.blocks.items():
        block_plan = _block_plan(
            sequence_parallel, swiglu=model.args.mlp == "swiglu", qk_norm=model.args.qk_norm
        )
        if not hasattr(block, "mlp"):
            # An MoE block: its router and experts run replicated over tp, on the full
            # sequence, so only the norm and attention split. Under SP the layer gathers the
            # sequence on entry and keeps this rank's chunk of its output: routing, capacity and
            # the balancing losses then see every token of the micro-batch, as without tp, and
            # every tp rank computes the same expert gradients (the backward all-gathers the
            # chunks' output gradients).
            block_plan = {
                k: v for k, v in block_plan.items() if k != "mlp" and not k.startswith("mlp.")
            }
            if sequence_parallel:
                block_plan["moe"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                )
        plan.update({f"blocks.{key}.{name}": style for name, style in block_plan.items()})
    if model.norm is not None:
        plan["norm"] = (
            SequenceParallel(use_local_output=True) if sequence_parallel else ReplicatedParallel()
        )
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        )
    return plan
