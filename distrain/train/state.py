"""What a checkpoint holds of the model, its optimizers and the RNGs, as DCP `Stateful`s: weights
and optimizer state under the full model's parameter names (so any layout loads them), and the
RNG states.

Under DiLoCo the sites' weights and inner optimizer states differ between outer steps: each
site keeps its own (`SiteState`), the model's entries are the global weights (what export and
inference read), and the outer momentum and step count are `OuterState`'s."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from distrain.checkpoint.load import SavedLayoutAware
from distrain.errors import CheckpointError
from distrain.family.spec import ModelSpec
from distrain.optim.diloco import DiLoCo
from distrain.optim.diloco_resume import site_change_problem
from distrain.optim.param_groups import roles_of
from distrain.optim.state_dict import load_optimizer_state_dict, optimizer_state_dict
from distrain.parallel.mesh import ParallelDims
from distrain.train.rng import rng_state, set_rng_state


class ModelState(Stateful):
    """All model parts' weights under their original names, so any layout can load them."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


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


class SiteState(SavedLayoutAware):
    """`inner`'s entries for DiLoCo site `site`: its tensors under `site<site>.<key>`, so each
    site saves and loads its own; the other entries (the optimizer's group hyperparameters,
    alike on every site, which DCP saves from one rank only) under their own keys. From a
    checkpoint of another number of sites, site s loads saved site s mod that number's."""

    def __init__(self, inner: Stateful, site: int):
        self.inner, self.site = inner, site
        self.prefix = f"site{site}."

    def saved_manifest(self, manifest: dict[str, Any]) -> None:
        saved = ParallelDims.sites_in(str(manifest.get("layout", "")))
        if saved is not None:
            self.prefix = f"site{self.site % saved}."

    def state_dict(self) -> dict:
        return {
            f"{self.prefix}{k}" if isinstance(v, torch.Tensor) else k: v
            for k, v in self.inner.state_dict().items()
        }

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict({k.removeprefix(self.prefix): v for k, v in state.items()})


class GlobalWeights(Stateful):
    """DiLoCo's global weights under the parameters' names, placed as the parameters (so any
    layout of a site loads them), in place of the model's entries."""

    def __init__(self, outer: DiLoCo):
        self.outer = outer

    def state_dict(self) -> dict:
        return self.outer.named(self.outer.global_weights)

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_named(self.outer.global_weights, state)


class OuterState(SavedLayoutAware):
    """DiLoCo's outer momentum (`momentum.<param name>`; each fragment's under streaming, as
    the fragments partition the parameters), its count of outer steps and, with
    diloco.overlap_steps, the fragment in flight (`in_flight.*`, optim/diloco.py). A checkpoint
    of another number of sites loads only as `site_change_problem` allows."""

    def __init__(self, outer: DiLoCo):
        self.outer = outer

    def saved_manifest(self, manifest: dict[str, Any]) -> None:
        problem = site_change_problem(manifest, self.outer.num_sites)
        if problem is not None:
            raise CheckpointError(problem)

    def state_dict(self) -> dict:
        momentum = self.outer.named(self.outer.momentum)
        state = {
            **{f"momentum.{k}": v for k, v in momentum.items()},
            "outer_steps": torch.tensor(self.outer.outer_steps),
        }
        if self.outer.cfg.overlap_steps:
            in_flight = self.outer.in_flight_state()
            state |= {f"in_flight.{k}": v for k, v in in_flight.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        momentum = {
            k.removeprefix("momentum."): v for k, v in state.items() if k.startswith("momentum.")
        }
        self.outer.load_named(self.outer.momentum, momentum)
        self.outer.outer_steps = int(state["outer_steps"])
        if self.outer.cfg.overlap_steps:
            self.outer.load_in_flight(
                {
                    k.removeprefix("in_flight."): v
                    for k, v in state.items()
                    if k.startswith("in_flight.")
                }
            )


class RNGState(Stateful):
    """Every rank is seeded alike, so rank 0's states (DCP keeps one copy) serve all ranks."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)
