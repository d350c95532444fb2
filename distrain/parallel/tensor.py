"""Megatron-style tensor parallelism (TP) with optional sequence parallelism (SP) for the GPT.

This module owns the TP layout plan: which GPT parameters are split over the tensor-parallel mesh
axis and where activations are gathered or scattered, expressed with DTensor parallel styles and
applied from the outside by `parallelize_module` (the model itself holds no parallel code), and
the loss context the trainer wraps the cross entropy and its backward in. Whether a model splits
evenly over `parallel.tp` ranks is one of layout/rules.py's rules (DTensor would accept uneven
shards: a head cut between ranks is no longer attention).

The split (Megatron-LM): attention heads and the MLP's hidden units are divided over the ranks
(wq/wk/wv and w_up column-parallel, wo and w_down row-parallel), so each block costs one
all-reduce in forward and one in backward per sub-layer. The token embedding and the output head
are split over the vocabulary; the logits stay vocab-sharded and the loss is computed
vocab-parallel, so no rank ever holds [B, T, vocab]. With SP the residual stream between
sub-layers is sharded over the sequence instead of replicated: norms then run on a 1/tp slice
and each all-reduce becomes a reduce-scatter + all-gather pair with the same traffic.

What callers must know:
- Every parameter becomes a DTensor on the tp mesh: split weights are Shard(0)/Shard(1), the
  rest (norm weights, learned positions) Replicate, so optimizers, `clip_grad_norm_` and DCP see
  one kind of tensor. `init_weights` gives each its slice of the seeded full value.
- Between modules activations are plain tensors: the full sequence without SP, this rank's
  contiguous chunk of the sequence (torch.chunk order) with SP.
- The logits are a DTensor sharded over the vocabulary (Shard(-1)). Compute the cross entropy
  AND call backward inside `tp_loss_context(True)`; the loss is then a Replicate DTensor, whose
  `.full_tensor()` is a plain tensor without communication (for logging, summing micro-batch
  losses). For sampling or evaluation outside that context use `logits.full_tensor()`.
- Under SP a sequence's length must divide by tp (`check_sequence_length`, also enforced on
  every forward), which applies to generation too.
- Not every gradient arrives in its parameter's layout (DTensor's own op rules): the
  vocab-parallel embedding's weight gradient is computed full-size (Replicate without SP,
  Partial with SP) and SP norm weights get Partial gradients. Accumulation over micro-batches,
  `clip_grad_norm_` and the optimizer handle them (reducing or slicing as they go);
  `.full_tensor()` gives the true gradient.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from distrain.errors import ConfigError
from distrain.models.gpt import GPT


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Under SP every rank holds seq_len / tp positions; refuse a length that does not split.

    DTensor pads uneven sequence shards, but the padded collectives disagree across ranks and
    gloo aborts the process instead of raising, so this is checked before any communication.
    """
    if seq_len % tp:
        raise ConfigError(
            f"sequence parallelism splits the {seq_len} positions of a sequence over parallel.tp "
            f"({tp}) ranks; use a sequence length (training.seq_len) that is a multiple of {tp}, "
            "or set parallel.sequence_parallel = false"
        )


def _replicated_inputs(
    _module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh
) -> tuple[Any, ...]:
    """Every rank passes the same full input (token positions, or the replicated residual)."""
    return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs)


def _local_output(
    layout: Placement, _module: nn.Module, output: DTensor, _mesh: DeviceMesh
) -> torch.Tensor:
    return output.redistribute(placements=(layout,)).to_local()


class _Replicated(ParallelStyle):
    """A module TP does not split: its parameters become Replicate DTensors, it computes on the
    full input, and hands back a plain tensor laid out as `output_layout` (Shard(0) cuts this
    rank's chunk of a [T, D] position table to match a sequence-sharded residual).

    Why not leave such modules plain: `clip_grad_norm_` and foreach optimizers cannot mix
    DTensor and plain parameters, and one kind of parameter keeps DCP checkpoints uniform.
    """

    def __init__(self, *, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = Replicate() if output_layout is None else output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition_fn: distribute_module then replicates every parameter (from rank 0 when
        # materialized; identical anyway, as init is seeded and rank-independent).
        return distribute_module(
            module,
            device_mesh,
            input_fn=_replicated_inputs,
            output_fn=partial(_local_output, self.output_layout),
        )


def _block_plan(sequence_parallel: bool, *, swiglu: bool) -> dict[str, ParallelStyle]:
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
    if not sequence_parallel:
        plan["attn_norm"] = plan["mlp_norm"] = _Replicated()
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


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Split `model` in place over the 1-D mesh `tp_mesh` (the tp axis of the full mesh).

    Works on a model still on the meta device (then materialize with `to_empty` and
    `init_weights`) and on a materialized one (each rank must then hold the same values). A
    pipeline stage that lacks the embedding, the final norm or the head is handled; a stage's
    hidden-state input and output are then this rank's sequence chunk under SP.

    Tied embeddings are kept tied: the vocab-parallel embedding and the column-parallel head both
    shard the shared [vocab, dim] weight as Shard(0), so after each module is parallelized
    (which replaces its parameter) the head is pointed back at the embedding's DTensor.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh (its tp axis), got {tp_mesh}")
    residual = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel and model.tok_emb is not None:
        tp = tp_mesh.size()
        model.register_forward_pre_hook(
            lambda _model, inputs: check_sequence_length(inputs[0].shape[1], tp)
        )
    if model.tok_emb is not None:
        parallelize_module(
            model.tok_emb,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        )
    if model.pos_emb is not None:
        # Looked up for all T positions, then cut to this rank's sequence chunk under SP; the
        # backward all-gathers the chunks' gradients, so every rank updates every position.
        parallelize_module(
            model.pos_emb,
            tp_mesh,
            _Replicated(output_layout=Shard(0) if sequence_parallel else None),
        )
    for block in model.blocks.values():
        plan = _block_plan(sequence_parallel, swiglu=model.args.mlp == "swiglu")
        if not hasattr(block, "mlp"):
            # An MoE block: its router and experts run replicated over tp, on the full
            # sequence, so only the norm and attention split. Under SP the layer gathers the
            # sequence on entry and keeps this rank's chunk of its output: routing, capacity and
            # the balancing losses then see every token of the micro-batch, as without tp, and
            # every tp rank computes the same expert gradients (the backward all-gathers the
            # chunks' output gradients).
            plan = {k: v for k, v in plan.items() if k != "mlp" and not k.startswith("mlp.")}
            if sequence_parallel:
                plan["moe"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                )
        parallelize_module(block, tp_mesh, plan)
    if model.norm is not None:
        norm_style = SequenceParallel(use_local_output=True) if sequence_parallel else _Replicated()
        parallelize_module(model.norm, tp_mesh, norm_style)
    if model.output is not None:
        parallelize_module(
            model.output,
            tp_mesh,
            ColwiseParallel(
                input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
            ),
        )
    if model.args.tie_embeddings and model.tok_emb is not None and model.output is not None:
        model.output.weight = model.tok_emb.weight


def tp_loss_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """`loss_parallel()` when the model is tensor-parallel, else a no-op.

    Wrap both `F.cross_entropy(logits, targets)` and the backward call in it: the vocab-sharded
    logits' loss and its gradient are computed with small all-reduces instead of gathering the
    logits, and torch requires the backward under the same context.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
