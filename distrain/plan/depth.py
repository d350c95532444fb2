"""The memory of a deep model from fake builds of two shallow ones.

A transformer's blocks are alike, so every figure of a rank's memory is linear in the blocks it
holds: each block adds its parameters, gradients and optimizer state, and the activations it
saves for backward, to every point of the step, and the transients of the block running at the
peak do not depend on how many blocks came before it, once a stage has a first and a last block
(with one block, that block is both, and a pipeline stage's peak under checkpointing then
differs). A layout with k >= 4 blocks per stage is therefore planned from builds with two and
three blocks per stage (periods, when the blocks repeat with a longer one: mixture-of-experts
layers every n blocks, selective checkpointing every n blocks): figure(k) = figure(2) +
(k - 2) (figure(3) - figure(2)). A fake step costs time in proportion to the blocks it runs, so
the two shallow builds of a 32-block model cost a sixth of the deep one. tests/test_plan.py
compares the two on whole plans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TypeVar

from distrain.config.schema import Config
from distrain.layout.rules import validate

T = TypeVar("T")


def block_period(cfg: Config) -> int:
    """Blocks after which the model repeats itself (its layers and their checkpointing)."""
    args = validate(cfg, None).model
    period = args.moe.every if args.moe.enabled else 1
    if cfg.training.activation_checkpointing == "selective":
        period = math.lcm(period, cfg.training.ac_every_layers)
    return period


def by_depth(cfg: Config, measure: Callable[[Config], T]) -> T:
    """`measure(cfg)` (a dataclass of integers), from the builds at two and three periods of
    blocks per stage when the stages hold four periods or more, else from `cfg` itself."""
    p = cfg.parallel
    stages = p.pp * p.pp_stages_per_rank if p.pp > 1 else 1
    period = block_period(cfg)
    n_layers = validate(cfg, None).model.n_layers
    if n_layers % (stages * period) or n_layers // (stages * period) < 4:
        return measure(cfg)
    two, three = (
        measure(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n)))
        for n in (2 * stages * period, 3 * stages * period)
    )
    more = n_layers // (stages * period) - 2
    return dataclasses.replace(
        two,
        **{
            f.name: getattr(two, f.name) + more * (getattr(three, f.name) - getattr(two, f.name))
            for f in dataclasses.fields(two)
        },
    )
