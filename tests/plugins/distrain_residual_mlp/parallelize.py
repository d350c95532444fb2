"""The residual MLP's tensor-parallel plan: the embedding and head split over the vocabulary,
each MLP Megatron-style, the norms replicated. No sequence-parallel variant."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from distrain.parallel.tensor import ReplicatedParallel


def tensor_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if sequence_parallel:
        raise ValueError("the residual MLP has no sequence-parallel plan")
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for key in model.layers:
        plan[f"layers.{key}.ln"] = ReplicatedParallel()
        plan[f"layers.{key}.up"] = ColwiseParallel()
        plan[f"layers.{key}.down"] = RowwiseParallel()
    if model.ln_f is not None:
        plan["ln_f"] = ReplicatedParallel()
    if model.unembed is not None:
        plan["unembed"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan
