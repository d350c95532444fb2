"""What a model family tells the rest of distrain about itself: `ModelSpec`, and `ModelShape`,
the sizes of one of its models that the layout rules, the planner and the data checks read.

A family lives in one folder (models/<family>/): its plain module, its parallel plans, its
Hugging Face adapter, its flavors (named presets) and its parameter and FLOP counts, handed to
everyone else through one `ModelSpec`. The parallel mechanisms (parallel/: tensor, pipeline,
expert and data parallelism, activation checkpointing, compile) and the consumers above them
(layout rules, trainer, optimizer, planner, export, generation, evaluation, the CLI) know no
family: each reads what it needs from the spec. The registry (models/registry.py) finds a spec by
`model.family`; a family defined outside distrain registers through the
`distrain.model_families` entry point and needs no edit here or anywhere else.

What the spec says, and who reads it:
- `presets`, `config_fields`, `args_from_config`: the family's flavors by name, the `model.*`
  fields it reads, and its arguments from the `[model]` section (a flavor with the fields set
  over it, or a Hugging Face folder's config.json for `model.init_from`).
- `shape`, `num_params`, `flops_per_token`, `describe`: the sizes of a model of the family
  (`ModelShape`), its exact parameter count, its training FLOPs per token, and a one-line
  summary for `distrain presets`, all without building it.
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
- `embeddings`: the embedding tables, which the optimizer does not decay.
- `moe_layers`, `moe_settings`: the mixture-of-experts layers, for expert parallelism and the
  balancing losses (parallel/moe_stats.py).
- `hf`: the family's Hugging Face adapter (`HfAdapter`): `model.init_from`, `distrain export`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from distrain.config.schema import ModelConfig

Source = Callable[[str, torch.Size], torch.Tensor]
"""(parameter name, full shape) -> the parameter's full fp32 value (pretrained weights)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of one model that distrain reads without building it."""

    vocab_size: int
    max_seq_len: int
    """The longest sequence it takes (training.seq_len may not exceed it)."""
    dim: int
    """The width of the hidden state between blocks (what a pipeline stage hands on)."""
    n_layers: int
    """The number of blocks (what pipeline stages split)."""
    tp_split: tuple[tuple[str, int], ...] = ()
    """(model.<field>, size) of every size tensor parallelism splits over its ranks, in the
    order the layout rules name a size parallel.tp does not divide."""
    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    """The indices of the blocks whose MLP is a mixture of experts."""
    top_k: int = 0
    """The routed experts each token goes to (what expert parallelism sends per token)."""
    expert_params: int = 0
    """Parameters of every MoE layer's routed experts (what expert parallelism splits)."""
    kv_width: int = 0
    """The width of one token's keys (its values alike) in one block: what context parallelism
    passes between its ranks (0: no attention to split)."""


@dataclass(frozen=True, kw_only=True)
class HfAdapter:
    """A family's mapping to and from a Hugging Face model folder (config.json + safetensors)."""

    source: Callable[[str, Any], Source]
    """(model.init_from, args) -> Source: the folder's tensors as this family's parameters."""
    tensors: Callable[[Any], list[Any]]
    """(args) -> every tensor of the Hugging Face checkpoint (models/hf_files.py's `HfTensor`:
    its name there, the parameters it is made of, and the conversion), in a stable order."""
    config: Callable[..., dict[str, Any]]
    """(args, *, dtype) -> the folder's config.json."""


@dataclass(frozen=True, kw_only=True)
class ParamRoles:
    """What the optimizer and its saved state must know of one model part's parameters, by
    canonical name (`ModelSpec.param_roles`)."""

    undecayed: frozenset[str] = frozenset()
    """Embedding tables, and a head tied to one: never weight-decayed."""
    tied: tuple[str, str] | None = None
    """(the first stage's name, the last stage's name) of one weight the model shares."""
    cut: bool = False
    """The part is a pipeline stage without the first or the last stage's submodules: a tied
    weight it holds is a copy, the other copy on another stage."""


def _no_moe_layers(_model: nn.Module) -> list[nn.Module]:
    return []


def _no_moe_settings(_args: Any) -> None:
    return None


def _untied(_model: nn.Module) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model family, as the rest of distrain sees it (see the module docstring)."""

    name: str
    presets: Mapping[str, Any]
    """The family's flavors: arguments by name (`model.preset`)."""
    config_fields: frozenset[str]
    """The `model.*` fields (dotted below model: "dim", "moe.top_k") `args_from_config` reads;
    setting another one is refused before launch. family, preset and init_from are always
    read."""
    args_from_config: Callable[[ModelConfig], Any]
    """([model] section) -> the family's arguments, or a `ConfigError` naming the field."""
    shape: Callable[[Any], ModelShape]
    num_params: Callable[[Any], int]
    """(args) -> the exact parameter count, a tied weight counted once."""
    flops_per_token: Callable[[Any, int], float]
    """(args, seq_len) -> training FLOPs per token, forward and backward."""
    describe: Callable[[Any], str] = repr
    """(args) -> a one-line summary of the shape (`distrain presets`)."""
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
    sequence_parallel: bool = True
    """`tensor_plan` has a sequence-parallel variant (its second argument True)."""
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
    embeddings: tuple[str, ...] = ()
    """The names of the embedding tables' parameters (never weight-decayed; a head tied to one
    counts as it)."""
    moe_layers: Callable[[nn.Module], list[nn.Module]] = _no_moe_layers
    moe_settings: Callable[[Any], Any | None] = _no_moe_settings
    """(args) -> the MoE layers' settings (num_experts, balance, bias_update_rate: what
    `MoEStats` reads; top_k and capacity_factor: what the planner's answer says it priced), or
    None for a dense model."""
    hf: HfAdapter | None = None
    """The family's Hugging Face adapter, None if it has none."""

    def param_roles(self, part: nn.Module) -> ParamRoles:
        """The roles of `part`'s parameters (`part`: the whole model or one pipeline stage, not
        wrapped by DDP)."""
        tied = self.tied_weights(part)
        whole = _holds_any(part, self.first_stage) and _holds_any(part, self.last_stage)
        return ParamRoles(
            undecayed=frozenset(self.embeddings) | frozenset(tied or ()), tied=tied, cut=not whole
        )


def _holds_any(part: nn.Module, names: tuple[str, ...]) -> bool:
    """`part` keeps one of the submodules `names` (a family that names none keeps them all)."""
    return not names or any(getattr(part, name, None) is not None for name in names)


@dataclass(frozen=True)
class FamilyModel:
    """One model of a family, described rather than built: its family's spec and arguments
    (what the planner prices)."""

    spec: ModelSpec
    args: Any

    @property
    def shape(self) -> ModelShape:
        return self.spec.shape(self.args)

    def num_params(self) -> int:
        return self.spec.num_params(self.args)

    def flops_per_token(self, seq_len: int) -> float:
        return self.spec.flops_per_token(self.args, seq_len)

    def build(self) -> nn.Module:
        """The plain model, on the default device (the meta device under `torch.device`)."""
        return self.spec.build(self.args)
