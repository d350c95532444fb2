"""The trainer: its parts, one training step, and the loop that runs the steps until
training.steps.

`Trainer.train_step` is the step, top to bottom: the loss's divisor, forward and backward over
this rank's micro-batches (accumulated, mixed precision; under training.oom_recovery retried with
half the micro-batch, oom.py), the gradients averaged between replica groups (ft/), then the
optimizers (optim/optimizers.py: unscale, clip, the update unless the non-finite guard says no,
zero_grad), MoE statistics and, under DiLoCo, the outer step when it is due (optim/diloco.py).
Under replica groups each step runs inside `ReplicaGroups.until_committed`, which redoes it
until every group of the quorum commits it.

`Trainer.run` is the loop: data -> step -> observe -> evaluate -> checkpoint. At logged steps the
loss and gradient norm are read (the loop's only host syncs outside fp16 and health checks) and
the metrics row goes through the observers (observe/observer.py); a stop signal agreed by every
rank ends the run with a preempt checkpoint. The parts are assembled once by `build_trainer`
(build.py); fault injection goes through `FaultInjection` (fault_injection.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import step_name
from distrain.checkpoint.policy import CheckpointPolicy
from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader, val_batches
from distrain.data.dataset import Batch
from distrain.data.loader import val_sample
from distrain.errors import CheckpointError
from distrain.ft.replica_groups import ReplicaGroups, copy_into, transferable
from distrain.launch.preempt import Preempted, StopAgreement, StopSignals, preempted_message
from distrain.observe import heartbeat
from distrain.observe.health import NonFiniteGuard
from distrain.observe.metrics import MetricsWriter
from distrain.observe.observer import StepObserver
from distrain.observe.profiling import PhaseRanges
from distrain.optim.diloco import DiLoCo
from distrain.optim.optimizers import Optimizers
from distrain.parallel.device import DistContext
from distrain.parallel.mesh import ParallelDims
from distrain.parallel.model import ParallelModel
from distrain.parallel.run_plan import RunPlan
from distrain.train import oom
from distrain.train.fault_injection import FaultInjection
from distrain.train.rng import rng_state, set_rng_state
from distrain.train.state import GlobalWeights, ModelState, OuterState, RNGState, SiteState

StepResult = tuple[torch.Tensor, torch.Tensor, float]
"""(loss, gradient norm, learning rate) of a step; the first two on the device."""


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
    optimizers: Optimizers
    oom: oom.OutOfMemoryRecovery | None
    """training.oom_recovery: forward and backward retried with half the micro-batch."""
    replicas: ReplicaGroups | None
    """fault_tolerance.replica_groups: this group's seat among the replica groups."""
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
        model, optim = ModelState(self.model.parts), self.optimizers
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
        if self.optimizers.fp16:
            state["scaler"] = self.optimizers.scaler
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

    def train_step(self, batches: list[Batch], *, report_loss: bool = True) -> StepResult:
        """Optimizer step self.step + 1 over this rank's micro-batches: (loss, gradient norm,
        learning rate), the first two on the device, without a host sync. The model is in train
        mode (see `evaluate`). With report_loss=False the loss is left where it was computed
        (see `ParallelModel.forward_backward`): for steps that are not logged. self.step is the
        caller's to advance."""
        step = self.step + 1
        lr = self.optimizers.lr_at(self.step)
        # The loss is the mean over the global batch's targets: under data.document_masking
        # samples hold unequally many, so the ranks add up their counts first (one all-reduce
        # of a scalar); otherwise every rank's count is known to be the same.
        masked = self.cfg.data.document_masking
        share = self.model.target_share(batches, self.grad_group if masked else None)
        if self.oom is None:
            loss = self.model.forward_backward(
                batches,
                self.optimizers.scale,
                sync=self.optimizers.sync_in_backward(),
                report_loss=report_loss,
                target_share=share,
            )
        else:
            loss = self.oom.forward_backward(batches, share, step=step)
        heartbeat.mark("optimizer")
        self.faults.after_backward(step, self.model.parameters)
        if self.replicas is not None:
            # Raises StepNotCommitted, gradients dropped, if some group failed: see `_next_step`.
            loss = self.replicas.average(loss, self.model.parameters)
        grad_norm = self.optimizers.unscale_and_clip()
        # Under fp16 the scaler skips a step whose (agreed) gradients overflowed.
        update = self.optimizers.fp16 or self.nonfinite.step_ok(
            grad_norm,
            step=step,
            named_params=self.optimizers.named_gradients(),
            agreed=self.optimizers.norm_agreed(),
        )
        self.optimizers.step(lr, update=update, step=step)
        if self.model.moe_stats is not None:
            self.model.moe_stats.after_step(updated=update)
        if self.outer is not None:
            self.outer.after_step(step)
        return loss, grad_norm, lr

    def _next_step(self, *, report_loss: bool) -> StepResult:
        """The next step on the next global batch: once, or, under replica groups, until every
        group of the quorum commits it (which always reports the loss: the groups average it)."""
        if self.replicas is None:
            return self.train_step(self.loader.next_batch(), report_loss=report_loss)
        return self.replicas.until_committed(
            lambda: self.train_step(self.loader.next_batch(), report_loss=True)
        )

    # --- the live state a rejoining replica group takes from this rank --------------------

    def _live_state(self) -> dict[str, Any]:
        """This rank's shards of the model and optimizer, the loader position, the RNG states
        and the step: what the same rank of a rejoining replica group loads."""
        return transferable(
            {
                "model": ModelState(self.model.parts).state_dict(),
                "optim": self.optimizers.state_dict(),
                "data": self.loader.state_dict(),
                "rng": rng_state(),
                "trainer": {"step": torch.tensor(self.step)},
            }
        )

    def _load_live_state(self, received: dict[str, Any]) -> None:
        model = ModelState(self.model.parts)
        weights, moments = model.state_dict(), self.optimizers.state_dict()
        copy_into(weights, received["model"], where="model.")
        copy_into(moments, received["optim"], where="optim.")
        model.load_state_dict(weights)
        self.optimizers.load_state_dict(moments)
        self.loader.load_state_dict(received["data"])
        set_rng_state(received["rng"])
        self.step = int(received["trainer"]["step"])

    def _world_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over all ranks: every tp and pp rank of a replica holds its replica's value, so
        this is the data-parallel mean (gloo has no AVG op, so SUM / size)."""
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values / self.ctx.world_size

    def eval_sequences(self, dataset: Dataset | None = None) -> int:
        """How many sequences a validation pass of `dataset` (default: the validation split)
        evaluates: training.eval_batches' set (data/loader.py `val_sample`)."""
        return len(
            val_sample(
                len(self.val_set if dataset is None else dataset),
                num_batches=self.cfg.training.eval_batches,
                global_batch_size=self.plan.batch.global_batch,
                seq_len=self.cfg.training.seq_len,
            )
        )

    @torch.no_grad()
    def evaluate(self, dataset: Dataset | None = None) -> float:
        """Mean loss over the targets of a fixed set of batches of `dataset` (default: the
        validation split); leaves the model in train mode.

        The set is training.eval_batches global batches spread over the whole split (`val_sample`;
        "auto": as much of it as EVAL_TOKENS allows), the same sequences throughout the run and
        on every layout; they are evaluated in micro-batches of the loader's current size, which
        out-of-memory recovery may have halved."""
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

    def _log_eval_size(self) -> None:
        """One line per validation set: how many sequences and tokens a pass evaluates, of how
        many the set holds."""
        seq_len = self.cfg.training.seq_len
        for name, dataset in {"validation split": self.val_set, **self.eval_sets}.items():
            count, held = self.eval_sequences(dataset), len(dataset)
            how = "all" if count == held else "all, wrapping" if count > held else "spread evenly"
            self.log.info(
                "validation: %s, %d of %d sequences of %d tokens (%s): val_tokens %d per pass",
                name,
                count,
                held,
                seq_len,
                how,
                count * seq_len,
            )

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        t = self.cfg.training
        heartbeat.mark("checkpoint")
        if self.ctx.rank == 0:
            self.checkpointer.storage.check_writable()
        self.maybe_resume()
        self.checkpointer.claim_location()
        if self.replicas is not None:
            self.replicas.begin(
                state=self._live_state,
                load=self._load_live_state,
                step=lambda: self.step,
                loader=self.loader,
            )
        if self.step >= t.steps:
            self.log.info(
                "run already finished at step %d (training.steps = %d)", self.step, t.steps
            )
            return
        self.started = True
        self._log_eval_size()
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
            loss, grad_norm, lr = self._next_step(report_loss=is_logged(step))
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
            if self.replicas is not None and not finished:
                self.replicas.next_quorum()
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
        """The validation split's loss, perplexity and tokens evaluated (val_loss, val_ppl,
        val_tokens), then each named set's (val/NAME/loss, val/NAME/ppl, val/NAME/tokens), and
        the pass's wall time (eval_s): one row."""
        start = time.perf_counter()
        val_loss = self.evaluate()
        seq_len = self.cfg.training.seq_len
        row = {
            "step": step,
            "val_loss": val_loss,
            "val_ppl": _perplexity(val_loss),
            "val_tokens": self.eval_sequences() * seq_len,
        }
        for name, dataset in self.eval_sets.items():
            loss = self.evaluate(dataset)
            row[f"val/{name}/loss"] = loss
            row[f"val/{name}/ppl"] = _perplexity(loss)
            row[f"val/{name}/tokens"] = self.eval_sequences(dataset) * seq_len
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
        if self.optimizers.fp16:
            row.update(
                loss_scale=self.optimizers.scaler.get_scale(),
                fp16_skipped=self.optimizers.fp16_skipped,
            )
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
        if self.replicas is not None:
            self.replicas.close()


def _perplexity(loss: float) -> float:
    """exp(mean loss); inf past what a float holds."""
    return math.exp(loss) if loss < 700 else math.inf
