"""A run's plan from its config (`resolve`): the layout rules checked on the world size (one
line naming the first rule it breaks), then every "auto" decided for this process's device and
logged (parallel/run_plan.py's `RunPlan`)."""

from __future__ import annotations

import logging

import torch

from distrain.config.schema import Config
from distrain.layout.rules import validate as validate_layout
from distrain.parallel.run_plan import RunPlan


def resolve(cfg: Config, device: torch.device, world_size: int, logger: logging.Logger) -> RunPlan:
    """Check `cfg` against the layout rules on `world_size` ranks and decide its "auto" choices
    for `device`, each logged."""
    layout = validate_layout(cfg, world_size)
    assert layout.dims is not None
    plan = RunPlan.decided(
        cfg, spec=layout.spec, model=layout.model, dims=layout.dims, device=device
    )
    t, decided = cfg.training, plan.config.training
    if t.precision == "auto":
        logger.info("training.precision auto: %s on %s", decided.precision, device)
    if t.compile == "auto":
        logger.info("training.compile auto: %s on %s", decided.compile, device)
    return plan
