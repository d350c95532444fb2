"""The run as it executes, decided once: `resolve` turns the config, this process's device and
the world size into a `RunPlan`, an immutable description the trainer's parts read: the layout
(model family and arguments, parallel degrees), the batch arithmetic, and a copy of the config
with every "auto" decided for this device (training.precision, training.compile). The user's
config is never changed, so config.toml keeps what the user asked for and the log says what
"auto" became.

training.micro_batch_size = "auto" is decided later, by trial steps on the built model
(autobatch.py), which is built for micro-batch 1 until then (`RunPlan.with_micro` gives the
plan with the choice). Out-of-memory recovery may halve the micro-batch during the run: that is
runtime state of the batch loader, which training and evaluation read alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from distrain.config.batch import BatchSizes
from distrain.config.schema import Config
from distrain.family.spec import ModelSpec
from distrain.layout.rules import validate as validate_layout
from distrain.parallel.device import resolve_compile, resolve_precision
from distrain.parallel.mesh import ParallelDims


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    config: Config
    """The run's config with every "auto" decided (a copy; the micro-batch size is 1 while
    `auto_micro_batch` waits for autobatch)."""
    spec: ModelSpec
    """The model family's."""
    model: object
    """The family's arguments for this run's model (what `spec.build` takes)."""
    dims: ParallelDims
    batch: BatchSizes
    auto_micro_batch: bool
    """training.micro_batch_size = "auto" and not decided yet."""

    def with_micro(self, micro: int) -> RunPlan:
        """This plan with the micro-batch size decided (by autobatch)."""
        t = replace(self.config.training, micro_batch_size=micro)
        return replace(
            self,
            config=replace(self.config, training=t),
            batch=self.batch.with_micro(micro),
            auto_micro_batch=False,
        )


def resolve(cfg: Config, device: torch.device, world_size: int, logger: logging.Logger) -> RunPlan:
    """Check `cfg` against the layout rules on `world_size` ranks (one line naming the first
    rule it breaks) and decide its "auto" choices for `device`, each logged."""
    layout = validate_layout(cfg, world_size)
    assert layout.dims is not None
    t = cfg.training
    precision = resolve_precision(t.precision, device)
    if t.precision == "auto":
        logger.info("training.precision auto: %s on %s", precision, device)
    compile = resolve_compile(t.compile, device)
    if t.compile == "auto":
        logger.info("training.compile auto: %s on %s", compile, device)
    auto_micro = t.micro_batch_size == "auto"
    micro = 1 if auto_micro else t.micro_batch_size
    resolved = replace(
        cfg, training=replace(t, precision=precision, compile=compile, micro_batch_size=micro)
    )
    batch = BatchSizes(global_batch=t.global_batch_size, dp=layout.dims.dp_size, micro=micro)
    return RunPlan(
        config=resolved,
        spec=layout.spec,
        model=layout.model,
        dims=layout.dims,
        batch=batch,
        auto_micro_batch=auto_micro,
    )
