"""What a checkpoint holds of the model, its optimizers and the RNGs, as DCP `Stateful`s: weights
and optimizer state under the full model's parameter names (so any layout loads them), and the
RNG states."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from distrain.optim import load_optimizer_state_dict, optimizer_state_dict
from distrain.rng import rng_state, set_rng_state


class ModelState(Stateful):
    """All model parts' weights under their original names, so any layout can load them."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """One optimizer per model part, flattened to `state.<param name>.<key>` entries so the parts'
    dicts merge and split again under another layout."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict:
        merged = {}
        for part, optimizer in zip(self.parts, self.optimizers, strict=True):
            merged.update(optimizer_state_dict(part, optimizer))
        return merged

    def load_state_dict(self, state: dict) -> None:
        for part, optimizer in zip(self.parts, self.optimizers, strict=True):
            load_optimizer_state_dict(part, optimizer, state)


class RNGState(Stateful):
    """Every rank is seeded alike, so rank 0's states (DCP keeps one copy) serve all ranks."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)
