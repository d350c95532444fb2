"""What a checkpoint holds of the model and the RNGs, as DCP `Stateful`s: weights under the full
model's parameter names (so any layout loads them), and the RNG states; the optimizers' state is
their own (optim/optimizers.py).

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
from distrain.optim.diloco import DiLoCo
from distrain.optim.diloco_resume import site_change_problem
from distrain.parallel.mesh import ParallelDims
from distrain.torch_compat import canonical_name
from distrain.train.rng import rng_state, set_rng_state


class ModelState(Stateful):
    """All model parts' weights under their original names, so any layout can load them. Frozen
    parameters (a LoRA run's base weights: lora.rank > 0) are left out: each start makes them
    again from model.init_from (or the seed), so the checkpoint holds only what trains."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        return {k: v for part in self.parts for k, v in _trained_state(part).items()}

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


def _trained_state(part: torch.nn.Module) -> dict:
    """`part`'s model state dict without its frozen parameters (under each of their names: a
    tied head's too, which the state dict holds beside the embedding's)."""
    frozen = {
        canonical_name(n)
        for n, p in part.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }
    state = get_model_state_dict(part)
    return {k: v for k, v in state.items() if k not in frozen} if frozen else state


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
