"""Optimizer state under the full model's parameter names, whatever the layout (DCP's flattened
optimizer state dict; ZeRO-1 and 1-bit Adam give their shards under the same names), so a
checkpoint of any layout loads into any other."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

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
