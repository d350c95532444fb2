"""The training loop: data -> step -> observe -> checkpoint, until training.steps.

A step is forward/backward over this rank's micro-batches (accumulated, mixed precision; the
`backward` strategy, backward.py, or oom.py's with out-of-memory recovery), clipping, the
optimizer update and the loss scale, and under DiLoCo the outer step when it is due
(optim/diloco.py). At logged steps the loss and gradient norm are read (the loop's only host
syncs outside fp16 and health checks) and the metrics row goes through the observers
(observe/observer.py); evaluation and checkpoints follow when due; a stop signal agreed by every
rank ends the run with a preempt checkpoint. How a step runs is the `steps` strategy (steps.py):
once, or under replica groups with the groups' quorum, the gradients averaged between groups
after backward and a step some group failed redone by the survivors. The parts are assembled
once by `build_trainer` (build.py); fault injection goes through `FaultInjection`
(fault_injection.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import step_name
from distrain.checkpoint.policy import CheckpointPolicy
from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader, val_batches
from distrain.errors import CheckpointError
from distrain.launch.preempt import Preempted, StopAgreement, StopSignals, preempted_message
from distrain.observe import heartbeat
from distrain.observe.health import NonFiniteGuard
from distrain.observe.metrics import MetricsWriter
from distrain.observe.observer import StepObserver
from distrain.observe.profiling import PhaseRanges
from distrain.optim.diloco import DiLoCo
from distrain.optim.gradient_plan import GradientPlan
from distrain.optim.schedule import set_lr
from distrain.parallel.device import DistContext
from distrain.parallel.mesh import ParallelDims
from distrain.parallel.model import ParallelModel
from distrain.parallel.run_plan import RunPlan
from distrain.parallel.scaler import AgreedGradScaler
from distrain.train import oom
from distrain.train.backward import Backward
from distrain.train.fault_injection import FaultInjection
from distrain.train.state import (
    GlobalWeights,
    ModelState,
    OptimizerState,
    OuterState,
    RNGState,
    SiteState,
)
from distrain.train.steps import PlainSteps

Batch = tuple[torch.Tensor, ...]


@dataclass(kw_only=True, eq=False)
class Trainer:
    """A run's parts, assembled by `build_trainer`, and the loop that runs them."""

    plan: RunPlan
    ctx: DistContext
    log: logging.Logger
    run_dir: Path
    dp_rank: int
    grad_group: dist.ProcessGroup
    """The ranks gradients are averaged over: dp, or dp x cp under context parallelism."""
    loader: DistributedBatchLoader
    """Its micro-batch size is the run's current one (autobatch's choice, halved by
    out-of-memory recovery): training and evaluation both read it there."""
    val_set: Dataset
    eval_sets: dict[str, Dataset]
    """data.eval_sets by name, evaluated after val_set at every validation pass."""
    model: ParallelModel
    optimizers: list[torch.optim.Optimizer]
    gradient_plan: GradientPlan
    """How the optimizers want the gradients: synchronized in backward, averaged, clipped."""
    backward: Backward
    """How the step makes its gradients: plainly, or recovering from out-of-memory errors."""
    steps: PlainSteps
    """How the loop runs a step: once, or as one replica group among several."""
    scaler: AgreedGradScaler
    checkpointer: Checkpointer
    checkpoint_policy: CheckpointPolicy
    stop_signals: StopSignals
    stop: StopAgreement
    nonfinite: NonFiniteGuard
    metrics: MetricsWriter
    """Also among the observers (it writes each logged row); extra rows go to it directly."""
    faults: FaultInjection
    observers: list[StepObserver]
    """Called in this order on every rank; the metrics writer and the progress display last."""
    phase_ranges: PhaseRanges
    outer: DiLoCo | None = None
    """DiLoCo's outer optimizer (diloco.inner_steps > 0)."""
    step: int = 0
    started: bool = False
    """True once the loop begins: an error before that is a failed start (see worker.py)."""
    fp16_skipped: int = 0
    """Steps the loss scaler skipped (gradients overflowed on some rank)."""
    step_state: dict[str, torch.Tensor] = field(
        default_factory=lambda: {"step": torch.zeros((), dtype=torch.int64)}
    )

    @property
    def cfg(self) -> Config:
        return self.plan.config

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    # --- checkpoints -------------------------------------------------------------------------

    def _state(self) -> dict:
        # The model's entries before the optimizer's: asking FSDP2 for them reshards the
        # parameters that an evaluation's forward left gathered (ZeRO-2), which the optimizer's
        # state is keyed by.
        model = ModelState(self.model.parts)
        optim = OptimizerState(self.model.parts, self.optimizers, self.model.spec)
        if self.outer is None:
            state = {"model": model, "optim": optim}
        else:
            site = self.outer.site
            state = {
                "model": GlobalWeights(self.outer),
                "site_model": SiteState(model, site),
                "optim": SiteState(optim, site),
                "outer": OuterState(self.outer),
            }
        state.update(trainer=self.step_state, data=self.loader, rng=RNGState())
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler
        return state

    def save_checkpoint(self, kind: str | None, *, preempt: bool = False) -> None:
        """Save this step's checkpoint: `kind` is what the policy made due ("permanent",
        "temporary" or None); `preempt` marks the save a stop signal asked for."""
        self.step_state["step"].fill_(self.step)
        notes = None if self.outer is None else self.outer.manifest_notes()
        self.checkpointer.save(
            self.step, self._state(), permanent=kind == "permanent", preempt=preempt, notes=notes
        )
        self.faults.after_save(self.step, self.checkpointer)

    def maybe_resume(self) -> None:
        step = self.checkpointer.restore_latest(self._state())
        if step is None:
            if self.cfg.run.resume:
                raise CheckpointError(
                    f"--resume: no complete checkpoint under {self.checkpointer.storage.url}; "
                    "drop --resume to start a new run"
                )
            return
        self.step = int(self.step_state["step"])
        if self.step != step:
            raise CheckpointError(f"checkpoint of step {step} holds step {self.step}")
        self.log.info("resumed from checkpoint step-%08d", self.step)

    # --- one step ----------------------------------------------------------------------------

    def train_step(
        self, batches: list[Batch], lr: float, *, report_loss: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro-batches; returns (mean loss, grad norm) on
        the device, without a host sync. The model is in train mode (see `evaluate`). With
        report_loss=False the loss is left where it was computed (see
        `ParallelModel.forward_backward`): for steps that are not logged.

        The loss is the mean over the global batch's targets: under data.document_masking
        samples hold unequally many, so the ranks add up their counts first (one all-reduce of
        a scalar); otherwise every rank's count is known to be the same."""
        plan = self.gradient_plan
        share = self.model.target_share(
            batches, self.grad_group if self.cfg.data.document_masking else None
        )
        loss = self.backward(batches, share, step=self.step + 1, report_loss=report_loss)
        heartbeat.mark("optimizer")
        self.faults.after_backward(self.step + 1, self.model.parameters)
        loss = self.steps.between_groups(loss, self.model.parameters)
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        plan.before_clip()
        grad_norm = plan.clip(
            self.cfg.optim.max_grad_norm or math.inf,
            counted_elsewhere=self.model.counted_elsewhere,
        )
        update = self.scaler.is_enabled() or self.nonfinite.step_ok(
            grad_norm,
            step=self.step + 1,
            named_params=plan.named_gradients(),
            agreed=plan.norm_agreed(),
        )
        if update:
            for optimizer in self.optimizers:
                set_lr(optimizer, lr)
                self.scaler.step(optimizer)
        self._update_scale()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.model.moe_stats is not None:
            self.model.moe_stats.after_step(updated=update)
        if self.outer is not None:
            self.outer.after_step(self.step + 1)
        return loss, grad_norm

    def _update_scale(self) -> None:
        """scaler.update(), noting a skipped step: the scale only drops when the (agreed)
        gradients overflowed. Reading the scale syncs the host, but scaler.step just did so
        reading the found-inf flag, so fp16 costs no extra wait."""
        if not self.scaler.is_enabled():
            self.scaler.update()
            return
        before = self.scaler.get_scale()
        self.scaler.update()
        after = self.scaler.get_scale()
        if after < before:
            self.fp16_skipped += 1
            self.log.warning(
                "step %d: fp16 gradients overflowed on some rank: step skipped by every rank, "
                "loss scale %g -> %g",
                self.step + 1,
                before,
                after,
            )

    def _world_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over all ranks: every tp and pp rank of a replica holds its replica's value, so
        this is the data-parallel mean (gloo has no AVG op, so SUM / size)."""
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values / self.ctx.world_size

    @torch.no_grad()
    def evaluate(self, dataset: Dataset | None = None) -> float:
        """Mean loss over the targets of a fixed set of batches of `dataset` (default: the
        validation split); leaves the model in train mode.

        The set is training.eval_batches global batches, the same sequences throughout the run
        and on every layout; they are evaluated in micro-batches of the loader's current size,
        which out-of-memory recovery may have halved."""
        self.model.train(False)
        batches = val_batches(
            self.val_set if dataset is None else dataset,
            num_batches=self.cfg.training.eval_batches,
            global_batch_size=self.plan.batch.global_batch,
            micro_batch_size=self.plan.batch.micro,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp_size,
        )
        if self.loader.micro_batch_size != self.plan.batch.micro:
            batches = oom.split(batches, self.loader.micro_batch_size)
        summed, targets = self._world_mean(self.model.eval_loss(batches)).tolist()
        self.model.train(True)
        # Every tp and pp rank of a replica holds its replica's sums: the ratio is unchanged.
        return summed / targets

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        t = self.cfg.training
        heartbeat.mark("checkpoint")
        if self.ctx.rank == 0:
            self.checkpointer.storage.check_writable()
        self.maybe_resume()
        self.checkpointer.claim_location()
        self.steps.begin(self)
        if self.step >= t.steps:
            self.log.info(
                "run already finished at step %d (training.steps = %d)", self.step, t.steps
            )
            return
        self.started = True
        for observer in self.observers:
            observer.start(self.step)
        self.model.train(True)
        window_start, window_steps = time.perf_counter(), 0

        def is_logged(step: int) -> bool:
            return step % t.log_interval_steps == 0 or step == t.steps

        while self.step < t.steps:
            step = self.step + 1
            self.faults.step_begins(step)
            for observer in self.observers:
                observer.before_step(step)
            heartbeat.mark("data", step=step)
            self.faults.step_runs(step, self.model.parameters)
            loss, grad_norm, lr = self.steps.run(self, report_loss=is_logged(step))
            step = self.step + 1  # a peer's, where a failed attempt healed this replica group
            finished, logged = step == t.steps, is_logged(step)
            self.step = step
            window_steps += 1
            for observer in self.observers:
                observer.after_step(step)
            if logged:
                heartbeat.mark("log")
                self._log_window(
                    loss, grad_norm, lr, time.perf_counter() - window_start, window_steps
                )
            # Agreed by every rank for this step (see launch/preempt.py); the last step just
            # finishes.
            stopping = not finished and self.stop.stop_now()
            if not stopping and (
                (t.eval_interval_steps and step % t.eval_interval_steps == 0) or finished
            ):
                heartbeat.mark("eval")
                self._validation_pass(step)
            kind = self.checkpoint_policy.due(step, sync_point=logged)
            if kind is not None or stopping:
                heartbeat.mark("checkpoint")
                self.save_checkpoint(kind, preempt=stopping)
            if logged:
                self.checkpointer.report_settled()
            if stopping:
                self.checkpointer.wait()
                self.stop.close()
                raise Preempted(preempted_message(step, t.steps, self.stop.signal_name))
            if step % t.log_interval_steps == 0:
                window_start, window_steps = time.perf_counter(), 0
            for observer in self.observers:
                observer.step_end(step)
            self.steps.step_end(self, finished=finished)
        heartbeat.mark("checkpoint")
        self.checkpointer.wait()
        self.stop.close()
        newest = self.checkpointer.newest_committed
        self.log.info(
            "finished %d steps (newest committed checkpoint: %s)",
            self.step,
            "none" if newest is None else step_name(newest),
        )

    def _validation_pass(self, step: int) -> None:
        """The validation split's loss and perplexity (val_loss, val_ppl), then each named
        set's (val/NAME/loss, val/NAME/ppl), and the pass's wall time (eval_s): one row."""
        start = time.perf_counter()
        val_loss = self.evaluate()
        row = {"step": step, "val_loss": val_loss, "val_ppl": _perplexity(val_loss)}
        for name, dataset in self.eval_sets.items():
            loss = self.evaluate(dataset)
            row[f"val/{name}/loss"] = loss
            row[f"val/{name}/ppl"] = _perplexity(loss)
        row["eval_s"] = time.perf_counter() - start
        self.metrics.log(row)
        named = "".join(f", {name} {row[f'val/{name}/loss']:.4f}" for name in self.eval_sets)
        self.log.info("step %d: val_loss %.4f%s", step, val_loss, named)

    def _log_window(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, elapsed: float, steps: int
    ) -> None:
        """The logged step's metrics row: the world's mean loss and gradient norm (a host
        sync), speed over the window since the last logged step, then each observer's part."""
        loss_value, norm_value = self._world_mean(torch.stack([loss, grad_norm])).tolist()
        t = self.cfg.training
        row = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": norm_value,
            "tokens_per_s": t.global_batch_size * t.seq_len * steps / elapsed,
            "step_time_s": elapsed / steps,
        }
        if self.scaler.is_enabled():
            row.update(loss_scale=self.scaler.get_scale(), fp16_skipped=self.fp16_skipped)
        for observer in self.observers:
            observer.logged(row, steps=steps)

    def close(self) -> None:
        # After an error, a background save in flight gets the time a stop signal would.
        self.checkpointer.close(timeout_s=self.cfg.checkpoint.preempt_grace_s)
        self.loader.close()
        for observer in reversed(self.observers):
            observer.close()
        self.phase_ranges.close()
        heartbeat.unlisten(self.phase_ranges)
        self.stop_signals.close()
        self.steps.close()


def _perplexity(loss: float) -> float:
    """exp(mean loss); inf past what a float holds."""
    return math.exp(loss) if loss < 700 else math.inf
