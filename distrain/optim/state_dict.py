"""Optimizer state under the full model's parameter names, whatever the layout (DCP's flattened
optimizer state dict; ZeRO-1 and 1-bit Adam give their shards under the same names), so a
checkpoint of any layout loads into any other; `OptimizerState` merges the model parts'
optimizers into one such dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from distrain.family.spec import ModelSpec
from distrain.optim.param_groups import roles_of
from distrain.optim.zero1 import Zero1AdamW
from distrain.torch_compat import is_zero_redundancy_optimizer

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state flattened to `state.<param name>.<key>` entries (layout-independent).

    Under ZeRO-1 each rank returns the state of the parameters it owns (its partition's local
    AdamW, shared, not copied), so each rank saves its own shard and nothing is gathered; the
    names are those of any other layout, so any layout can load them. The group
    hyperparameters (`param_groups.<param name>.<key>`) are returned for every parameter: DCP
    saves non-tensor entries from its coordinator rank only.
    """
    zero = _zero1(optimizer)
    if zero is None:
        return get_optimizer_state_dict(model, optimizer, options=_FLAT)
    if isinstance(zero, Zero1AdamW) and zero.owns_nothing:
        return {}  # no state here; the group hyperparameters come from rank 0, an owner
    if not zero.optim.state:  # before the first step: let torch initialize the local state
        local = get_optimizer_state_dict(model, zero.optim, options=_FLAT)
        if not zero.optim.state:
            return local  # this rank owns no parameter (rank 0 always owns one)
    twin = torch.optim.AdamW([{**g, "params": list(g["params"])} for g in zero.param_groups])
    twin.state = zero.optim.state
    return get_optimizer_state_dict(model, twin, options=_FLAT)


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load flattened entries; under ZeRO-1 each rank loads those of its own partition."""
    zero = _zero1(optimizer)
    if isinstance(zero, Zero1AdamW) and zero.owns_nothing:
        return
    set_optimizer_state_dict(model, optimizer if zero is None else zero.optim, state, options=_FLAT)


def _zero1(optimizer: torch.optim.Optimizer) -> Any:
    """`optimizer` if it shards its state (ZeroRedundancyOptimizer or Zero1AdamW: its `optim`
    holds this rank's state)."""
    zero1 = isinstance(optimizer, Zero1AdamW) or is_zero_redundancy_optimizer(optimizer)
    return optimizer if zero1 else None


def _head_copy(part: torch.nn.Module, spec: ModelSpec) -> tuple[str, str] | None:
    """(the last stage's name, the first stage's name) of a tied weight when `part` is a
    pipeline stage with its own copy of it under the last stage's name (parallel/tied.py).
    Where the embedding and the head are one parameter, torch names it once, after the
    embedding, and the head's name has no optimizer state."""
    tied = roles_of(part, spec).tied
    if tied is None or not any(name == tied[1] for name, _ in part.named_parameters()):
        return None
    return tied[1], tied[0]


def _renamed(state: dict, old: str, new: str) -> dict:
    """`state` with the flattened entries of parameter `old` (`state.<old>.<key>`,
    `param_groups.<old>.<key>`) named after `new`; the other entries as they are."""
    renamed = {}
    for key, value in state.items():
        for section in ("state.", "param_groups."):
            if key.startswith(f"{section}{old}."):
                key = f"{section}{new}.{key.removeprefix(f'{section}{old}.')}"
        renamed[key] = value
    return renamed


class OptimizerState(Stateful):
    """One optimizer per model part, flattened to `state.<param name>.<key>` entries so the parts'
    dicts merge and split again under another layout.

    A tied embedding has one optimizer state, under the embedding's name, whatever the layout:
    a pipeline's last stage saves its head copy's state (equal to the embedding copy's, since
    both take the same summed gradient) under that name, and loads it from there, so a
    checkpoint of one layout resumes on any other."""

    def __init__(
        self,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        spec: ModelSpec,
    ):
        self.parts, self.optimizers = parts, optimizers
        self.copies = [_head_copy(part, spec) for part in parts]

    def state_dict(self) -> dict:
        merged = {}
        for part, optimizer, copy in zip(self.parts, self.optimizers, self.copies, strict=True):
            state = optimizer_state_dict(part, optimizer)
            if copy is not None:
                state = _renamed(state, *copy)
            merged.update(state)
        return merged

    def load_state_dict(self, state: dict) -> None:
        for part, optimizer, copy in zip(self.parts, self.optimizers, self.copies, strict=True):
            own = _renamed(state, copy[1], copy[0]) if copy is not None else state
            load_optimizer_state_dict(part, optimizer, own)
