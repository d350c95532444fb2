"""Tensor parallelism (TP) with optional sequence parallelism (SP), for any model family.

This module owns the mechanism: a family's `tensor_plan` (family/spec.py: which submodules get
which DTensor `ParallelStyle`) applied from the outside by `parallelize_module` (the model itself
holds no parallel code), the style for a module TP does not split (`ReplicatedParallel`), the
sequence-length check under SP, and the loss context the trainer wraps the loss and its backward
in. The decoder's plan (Megatron-LM's split) is models/decoder/parallelize.py's. Whether a
model splits evenly over `parallel.tp` ranks is one of layout/rules.py's rules (DTensor would
accept uneven shards: a head cut between ranks is no longer attention).

What callers must know:
- A plan turns every parameter into a DTensor on the tp mesh: split weights are
  Shard(0)/Shard(1), the rest Replicate (`ReplicatedParallel`), so optimizers,
  `clip_grad_norm_` and DCP see one kind of tensor. The family's `init_weights` gives each its
  slice of the seeded full value.
- Between modules activations are plain tensors: the full sequence without SP, this rank's
  contiguous chunk of the sequence (torch.chunk order) with SP.
- An output head may leave its logits a DTensor sharded over the vocabulary (Shard(-1), the
  decoder's). Compute the loss AND call backward inside `tp_loss_context(True)`; the loss is then a
  Replicate DTensor, whose `.full_tensor()` is a plain tensor without communication (for
  logging, summing micro-batch losses). For sampling or evaluation outside that context use
  `logits.full_tensor()`.
- Under SP a sequence's length must divide by tp (`check_sequence_length`, also enforced on
  every forward of a part fed token ids), which applies to generation too.
- Not every gradient arrives in its parameter's layout (DTensor's own op rules): a
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
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from distrain.errors import ConfigError
from distrain.family.spec import ModelSpec


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


class ReplicatedParallel(ParallelStyle):
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


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, spec: ModelSpec
) -> None:
    """Split `model` (a model of the family `spec`, or one pipeline stage of it) in place over
    the 1-D mesh `tp_mesh` (the tp axis of the full mesh), by the family's `tensor_plan`.

    Works on a model still on the meta device (then materialize with `to_empty` and
    `init_weights`) and on a materialized one (each rank must then hold the same values). A
    stage fed token ids has their sequence length checked under SP (`check_sequence_length`).

    Tied weights (`spec.tied_weights`) are kept tied: the plan must shard both alike, and after
    it has replaced each module's parameter, the second is pointed back at the first's DTensor.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh (its tp axis), got {tp_mesh}")
    if spec.tensor_plan is None:
        raise ConfigError(
            f"the {spec.name!r} model family has no tensor-parallel plan; set parallel.tp = 1"
        )
    if sequence_parallel:
        tp = tp_mesh.size()

        def check_tokens(_model: nn.Module, inputs: tuple[Any, ...]) -> None:
            # Token ids (integers), not hidden states: a later stage gets its chunk already.
            if not inputs[0].is_floating_point():
                check_sequence_length(inputs[0].shape[1], tp)

        model.register_forward_pre_hook(check_tokens)
    parallelize_module(model, tp_mesh, spec.tensor_plan(model, sequence_parallel))
    tied = spec.tied_weights(model)
    if tied is not None:
        _retie(model, *tied)


def _retie(model: nn.Module, first: str, second: str) -> None:
    """Point parameter `second` at parameter `first` when this model (stage) holds both."""
    try:
        shared = model.get_parameter(first)
        model.get_parameter(second)
    except AttributeError:
        return
    owner, _, name = second.rpartition(".")
    setattr(model.get_submodule(owner), name, shared)


def tp_loss_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """`loss_parallel()` when the model is tensor-parallel, else a no-op.

    Wrap both `F.cross_entropy(logits, targets)` and the backward call in it: the vocab-sharded
    logits' loss and its gradient are computed with small all-reduces instead of gathering the
    logits, and torch requires the backward under the same context.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
