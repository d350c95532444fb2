"""How the loop runs its steps: `PlainSteps`, one attempt of each step, or `ReplicatedSteps`
under replica groups (fault_tolerance.replica_groups): the groups' quorum before each step,
the average of the gradients between groups after backward, a step some group failed redone
by the survivors, and this rank's live state served to (or loaded from) a group that rejoins.
The loop (loop.py) calls the same four points either way."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader
from distrain.ft.replica_groups import ReplicaGroups, StepNotCommitted, copy_into, transferable
from distrain.optim.schedule import lr_at
from distrain.parallel.model import ParallelModel
from distrain.train.rng import rng_state, set_rng_state
from distrain.train.state import ModelState, OptimizerState


class TrainerView(Protocol):
    """What a step strategy reads and moves of the loop (loop.py's `Trainer`)."""

    step: int
    loader: DistributedBatchLoader
    model: ParallelModel
    optimizers: list[torch.optim.Optimizer]

    @property
    def cfg(self) -> Config: ...

    def train_step(
        self, batches: list[tuple[torch.Tensor, ...]], lr: float, *, report_loss: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


Result = tuple[torch.Tensor, torch.Tensor, float]
"""(loss, gradient norm, learning rate) of a step, on the device."""


class PlainSteps:
    """Each step runs once; a failure ends the run (an elastic restart resumes it)."""

    def begin(self, trainer: TrainerView) -> None:
        """The loop starts at trainer.step (resumed already)."""

    def run(self, trainer: TrainerView, *, report_loss: bool) -> Result:
        """Step trainer.step + 1 on the next global batch."""
        lr = lr_at(trainer.step, cfg=trainer.cfg.optim, total_steps=trainer.cfg.training.steps)
        loss, grad_norm = trainer.train_step(
            trainer.loader.next_batch(), lr, report_loss=report_loss
        )
        return loss, grad_norm, lr

    def between_groups(
        self, loss: torch.Tensor, params: Callable[[], Iterable[nn.Parameter]]
    ) -> torch.Tensor:
        """After backward, before the update: the loss the step reports (this rank's)."""
        return loss

    def step_end(self, trainer: TrainerView, *, finished: bool) -> None:
        """The step is logged, evaluated and checkpointed as due."""

    def close(self) -> None:
        pass


class ReplicatedSteps(PlainSteps):
    """Steps of one replica group among several (replica_groups.py): each committed by every
    group of the quorum, or redone by those left."""

    def __init__(self, replicas: ReplicaGroups):
        self.replicas = replicas

    def begin(self, trainer: TrainerView) -> None:
        self.replicas.serve(
            lambda: _live_state(trainer),
            lambda received: _load_live_state(trainer, received),
            step=trainer.step,
        )
        self.replicas.first_quorum(step=trainer.step, loader=trainer.loader)
        self.replicas.check_restart_has_a_source(step=trainer.step)

    def run(self, trainer: TrainerView, *, report_loss: bool) -> Result:
        """The step on this group's share of the global batch, redone until every group of the
        quorum commits it. After a failed attempt the loader and the RNG are put back where the
        step began and the survivors' new quorum re-plans the same global batch over the groups
        left. That quorum may also load a peer's live state (this group was cut off while the
        others went on), which moves trainer.step to the peer's: each attempt takes its step
        and learning rate from it. The loss is always reported (the groups average it)."""
        while True:
            started = time.perf_counter()
            position, rng = trainer.loader.state_dict(), torch.get_rng_state()
            try:
                result = super().run(trainer, report_loss=True)
            except StepNotCommitted as error:
                trainer.loader.load_state_dict(position)
                torch.set_rng_state(rng)
                self.replicas.step_failed(started, error)
                self.replicas.quorum(step=trainer.step, loader=trainer.loader)
                continue
            self.replicas.step_committed(trainer.step + 1)
            return result

    def between_groups(
        self, loss: torch.Tensor, params: Callable[[], Iterable[nn.Parameter]]
    ) -> torch.Tensor:
        """The gradients and the loss averaged over the groups of the quorum."""
        return self.replicas.average(loss, params)

    def step_end(self, trainer: TrainerView, *, finished: bool) -> None:
        if not finished:
            self.replicas.quorum(step=trainer.step, loader=trainer.loader)

    def close(self) -> None:
        self.replicas.close()


def _live_state(trainer: TrainerView) -> dict[str, Any]:
    """This rank's shards of the model and optimizer, the loader position, the RNG states and
    the step: what the same rank of a rejoining replica group loads."""
    parts, spec = trainer.model.parts, trainer.model.spec
    return transferable(
        {
            "model": ModelState(parts).state_dict(),
            "optim": OptimizerState(parts, trainer.optimizers, spec).state_dict(),
            "data": trainer.loader.state_dict(),
            "rng": rng_state(),
            "trainer": {"step": torch.tensor(trainer.step)},
        }
    )


def _load_live_state(trainer: TrainerView, received: dict[str, Any]) -> None:
    model = ModelState(trainer.model.parts)
    optim = OptimizerState(trainer.model.parts, trainer.optimizers, trainer.model.spec)
    weights, moments = model.state_dict(), optim.state_dict()
    copy_into(weights, received["model"], where="model.")
    copy_into(moments, received["optim"], where="optim.")
    model.load_state_dict(weights)
    optim.load_state_dict(moments)
    trainer.loader.load_state_dict(received["data"])
    set_rng_state(received["rng"])
    trainer.step = int(received["trainer"]["step"])
