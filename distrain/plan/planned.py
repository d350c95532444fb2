"""The `RunPlan` of a layout the planner prices: every fake build (memory.py, pipeline_memory.py,
probe.py) is made from one, the build store keeps builds under it, and the search carries one per
candidate layout (search.py). `planned_run` makes it from a config, `replanned` a variant of it
(another depth, ZeRO stage or world size).

Apart from the builds, so that a plan that reads every build from the store never imports the
training stack the builds run (build_results.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from distrain.config.schema import Config
from distrain.layout.rules import validate
from distrain.parallel.run_plan import RunPlan


def planned_run(cfg: Config, world_size: int) -> RunPlan:
    """The `RunPlan` a fake build of `cfg` on `world_size` ranks is made from (the layout rules
    checked): training.precision "auto" is planned as bf16, what it becomes on the GPUs the
    planner prices, and "auto" compile as this machine decides it (eager on CPU)."""
    layout = validate(cfg, world_size)
    if cfg.training.precision == "auto":
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, precision="bf16"))
    return RunPlan.decided(
        cfg, spec=layout.spec, model=layout.model, dims=layout.dims, device=torch.device("cpu")
    )


def replanned(plan: RunPlan, *, world_size: int | None = None, **sections: Any) -> RunPlan:
    """`plan` with these sections of its config replaced (`dataclasses.replace`'s keywords:
    `parallel=...`), planned again on `world_size` ranks (None: its own), the layout rules
    checked."""
    world = plan.dims.world_size if world_size is None else world_size
    return planned_run(dataclasses.replace(plan.config, **sections), world)
