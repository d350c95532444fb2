"""The run as it executes, decided once: `RunPlan`, an immutable description every component
that builds or runs the model reads (the trainer's parts, the planner's fake builds): the model
family and its arguments, the parallel degrees, the batch arithmetic, and a copy of the config
with every "auto" decided for the device (training.precision, training.compile). What builds the
model reads the sections it needs (`training`, `parallel`, `comm`), never the whole config. The
user's config is never changed, so config.toml keeps what the user asked for. train/resolve.py
makes the run's plan from its config (checking the layout rules and logging what "auto" became).

training.micro_batch_size = "auto" is decided later, by trial steps on the built model
(train/autobatch.py), which is built for micro-batch 1 until then (`RunPlan.with_micro` gives
the plan with the choice). Out-of-memory recovery may halve the micro-batch during the run:
that is runtime state of the batch loader, which training and evaluation read alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from distrain.config.batch import BatchSizes
from distrain.config.schema import CommConfig, Config, ParallelConfig, TrainingConfig
from distrain.family.spec import ModelSpec
from distrain.parallel.device import resolve_compile, resolve_precision
from distrain.parallel.mesh import ParallelDims


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    config: Config
    """The run's config with every "auto" decided (a copy; the micro-batch size is 1 while
    `auto_micro_batch` waits for autobatch)."""
    spec: ModelSpec
    """The model family's."""
    model: Any
    """The family's arguments for this run's model (what `spec.build` takes)."""
    dims: ParallelDims
    batch: BatchSizes
    auto_micro_batch: bool
    """training.micro_batch_size = "auto" and not decided yet."""

    @property
    def training(self) -> TrainingConfig:
        """The [training] section, its "auto" choices decided."""
        return self.config.training

    @property
    def parallel(self) -> ParallelConfig:
        return self.config.parallel

    @property
    def comm(self) -> CommConfig:
        return self.config.comm

    @property
    def init_from(self) -> str:
        """model.init_from: the pretrained weights the model starts from ("": none)."""
        return self.config.model.init_from

    @classmethod
    def decided(
        cls, cfg: Config, *, spec: ModelSpec, model: Any, dims: ParallelDims, device: torch.device
    ) -> RunPlan:
        """The plan of `cfg` (its layout already checked: `spec`, `model`, `dims`) with its
        "auto" choices decided for `device`."""
        t = cfg.training
        auto_micro = t.micro_batch_size == "auto"
        micro = 1 if auto_micro else t.micro_batch_size
        training = replace(
            t,
            precision=resolve_precision(t.precision, device),
            compile=resolve_compile(t.compile, device),
            micro_batch_size=micro,
        )
        return cls(
            config=replace(cfg, training=training),
            spec=spec,
            model=model,
            dims=dims,
            batch=BatchSizes(global_batch=t.global_batch_size, dp=dims.dp_size, micro=micro),
            auto_micro_batch=auto_micro,
        )

    def with_micro(self, micro: int) -> RunPlan:
        """This plan with the micro-batch size decided (by autobatch)."""
        t = replace(self.config.training, micro_batch_size=micro)
        return replace(
            self,
            config=replace(self.config, training=t),
            batch=self.batch.with_micro(micro),
            auto_micro_batch=False,
        )
