"""What a model family tells the parallel mechanisms about itself: `ModelSpec`.

The mechanisms in this package (tensor, pipeline, expert and data parallelism, activation
checkpointing, compile) know no model; each reads what it needs from the family's spec. A family
(models/gpt/ for the GPT and its MoE variant) builds one `ModelSpec` and registers it
(models/registry.py); a model defined anywhere else, a test file included, does the same and
trains under every layout without a change here.

What the spec says, and who reads it:
- `build`, `init_weights`, `loss`: the plain module from its arguments (built on the meta device
  by the caller), its seeded initialization (every parameter's value a function of the seed and
  its name, so that any layout gets the same model) and the loss of its output against targets.
- `blocks`: the attribute holding the repeated blocks, an `nn.ModuleDict` keyed "0".."n-1". A
  pipeline stage keeps a contiguous range of them; activation checkpointing, per-block compile
  and FSDP2 wrap each of them.
- `first_stage`, `last_stage`: the submodules only the first (last) pipeline stage keeps; they are
  set to None on the other stages, whose forward must then take (return) hidden states.
- `tensor_plan`: which submodules get which `ParallelStyle` under tensor parallelism.
- `attention_modules`: the modules whose `attend` kernel context parallelism replaces.
- `tied_weights`: two parameters that are one weight (a tied embedding and head).
- `moe_layers`, `moe_settings`: the mixture-of-experts layers, for expert parallelism and the
  balancing losses (parallel/moe_stats.py).
- `pretrained_source`: the family's Hugging Face adapter, for `model.init_from`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

Source = Callable[[str, torch.Size], torch.Tensor]
"""(parameter name, full shape) -> the parameter's full fp32 value (pretrained weights)."""


def _no_moe_layers(_model: nn.Module) -> list[nn.Module]:
    return []


def _no_moe_settings(_args: Any) -> None:
    return None


def _untied(_model: nn.Module) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model family, as the parallel mechanisms see it (see the module docstring)."""

    name: str
    args_type: type
    """The type of the family's arguments (what `build` takes): how a registry finds the family
    of a given model's arguments."""
    build: Callable[[Any], nn.Module]
    init_weights: Callable[..., None]
    """(model or stage, args, seed, *, source: Source | None) -> None: fill every parameter with
    its seeded value (or `source`'s), keeping only its own slice of a sharded (DTensor) one."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(output of the last stage, targets) -> the loss summed over the targets, skipping negative
    ones (cross_entropy's ignore_index); the caller divides by the global batch's target count."""
    blocks: str
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    tensor_plan: Callable[[nn.Module, bool], dict[str, ParallelStyle]] | None = None
    """(model or stage, sequence_parallel) -> {submodule path: style}, applied in order by
    `parallelize_module`; a submodule that this stage lacks (None) must be left out. Every
    parameter must end up a DTensor. None: the family has no tensor-parallel plan."""
    attention_modules: Callable[[nn.Module], list[nn.Module]] | None = None
    """(model or stage) -> its attention modules, each calling `self.attend(q, k, v)` on
    [B, H, T, D] with the whole sequence, or `self.attend(q, k, v, documents)` with the
    sequence's document ids [B, T] under data.document_masking (parallel/context.py swaps the
    kernel). None: the family has no attention for context parallelism."""
    loss_in_forward: bool = False
    """`model(inputs, targets=targets)` returns the summed loss, as `loss` does (so compiling
    the whole model puts the loss in its graph)."""
    tied_weights: Callable[[nn.Module], tuple[str, str] | None] = _untied
    """(model) -> (the first stage's name, the last stage's name) of one shared weight, or
    None. Kept tied under tensor parallelism; two copies kept equal across pipeline stages."""
    moe_layers: Callable[[nn.Module], list[nn.Module]] = _no_moe_layers
    moe_settings: Callable[[Any], Any | None] = _no_moe_settings
    """(args) -> the MoE layers' settings (num_experts, balance, bias_update_rate: what
    `MoEStats` reads), or None for a dense model."""
    pretrained_source: Callable[[str, Any], Source] | None = None
    """(model.init_from, args) -> Source: the family's Hugging Face adapter, None if it has
    none."""
