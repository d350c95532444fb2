"""The training loop: data -> step -> observe -> checkpoint, until training.steps.

A step is forward/backward over this rank's micro-batches (accumulated, mixed precision, with
out-of-memory recovery when asked), clipping, the optimizer update and the loss scale, and under
DiLoCo the outer step when it is due (optim/diloco.py). At logged steps the loss and gradient
norm are read (the loop's only host syncs outside fp16 and health checks) and the metrics row goes
through the observers (observe/observer.py); evaluation and checkpoints follow when due; a stop
signal agreed by every rank ends the run with a preempt checkpoint. Under replica groups
(fault_tolerance.replica_groups) each step begins with the groups' quorum, its gradients are
averaged between groups after backward, and a step some group failed is redone by the survivors
(replica_groups.py). The parts are assembled once by `build_trainer` (build.py); fault injection
goes through `Faults` (faults.py).
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
from distrain.optim.schedule import lr_at, set_lr
from distrain.parallel.device import DistContext
from distrain.parallel.mesh import ParallelDims
from distrain.parallel.model import ParallelModel
from distrain.parallel.scaler import AgreedGradScaler
from distrain.train import oom
from distrain.train.faults import Faults
from distrain.train.replica_groups import (
    ReplicaGroups,
    StepNotCommitted,
    copy_into,
    transferable,
)
from distrain.train.resolve import RunPlan
from distrain.train.rng import rng_state, set_rng_state
from distrain.train.state import (
    GlobalWeights,
    ModelState,
    OptimizerState,
    OuterState,
    RNGState,
    SiteState,
)

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
    scaler: AgreedGradScaler
    checkpointer: Checkpointer
    checkpoint_policy: CheckpointPolicy
    stop_signals: StopSignals
    stop: StopAgreement
    nonfinite: NonFiniteGuard
    metrics: MetricsWriter
    """Also among the observers (it writes each logged row); extra rows go to it directly."""
    faults: Faults
    observers: list[StepObserver]
    """Called in this order on every rank; the metrics writer and the progress display last."""
    phase_ranges: PhaseRanges
    outer: DiLoCo | None = None
    """DiLoCo's outer optimizer (diloco.inner_steps > 0)."""
    replicas: ReplicaGroups | None = None
    """This group's seat among the replica groups (fault_tolerance.replica_groups >= 2)."""
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
        if self.faults.damages_checkpoint(self.step):
            self.checkpointer.wait()
            if self.ctx.rank == 0:
                self.faults.damage_checkpoint(self.checkpointer.storage, self.step)

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

    # --- live state, for a replica group that rejoins ------------------------------------------

    def _live_state(self) -> dict:
        """This rank's shards of the model and optimizer, the loader position, the RNG states
        and the step: what the same rank of a rejoining replica group loads."""
        return transferable(
            {
                "model": ModelState(self.model.parts).state_dict(),
                "optim": OptimizerState(
                    self.model.parts, self.optimizers, self.model.spec
                ).state_dict(),
                "data": self.loader.state_dict(),
                "rng": rng_state(),
                "trainer": {"step": torch.tensor(self.step)},
            }
        )

    def _load_live_state(self, received: dict) -> None:
        model = ModelState(self.model.parts)
        optim = OptimizerState(self.model.parts, self.optimizers, self.model.spec)
        weights, moments = model.state_dict(), optim.state_dict()
        copy_into(weights, received["model"], where="model.")
        copy_into(moments, received["optim"], where="optim.")
        model.load_state_dict(weights)
        optim.load_state_dict(moments)
        self.loader.load_state_dict(received["data"])
        set_rng_state(received["rng"])
        self.step = int(received["trainer"]["step"])

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
        synced = plan.sync_in_backward()
        share = self.model.target_share(
            batches, self.grad_group if self.cfg.data.document_masking else None
        )
        if self.cfg.training.oom_recovery:
            loss = self._forward_backward_recovering(batches, share)
        else:
            loss = self.model.forward_backward(
                batches,
                self.scaler.scale,
                sync=synced,
                report_loss=report_loss,
                target_share=share,
            )
        heartbeat.mark("optimizer")
        self.faults.after_backward(self.step + 1, self.model.parameters)
        if self.replicas is not None:
            loss = self.replicas.average(loss, self.model.parameters)
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

    def _replicated_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """`train_step` on this group's share of the global batch, redone until every replica
        group of the quorum commits it; returns (loss, grad norm, learning rate). After a failed
        attempt the loader and the RNG are put back where the step began and the survivors' new
        quorum re-plans the same global batch over the groups left. That quorum may also load
        a peer's live state (this group was cut off while the others went on), which moves
        `self.step` to the peer's: each attempt takes its step and learning rate from it."""
        while True:
            lr = lr_at(self.step, cfg=self.cfg.optim, total_steps=self.cfg.training.steps)
            started = time.perf_counter()
            position, rng = self.loader.state_dict(), torch.get_rng_state()
            try:
                result = self.train_step(self.loader.next_batch(), lr, report_loss=True)
            except StepNotCommitted as error:
                self.loader.load_state_dict(position)
                torch.set_rng_state(rng)
                self.replicas.step_failed(started, error)
                self.replicas.quorum(step=self.step, loader=self.loader)
                continue
            self.replicas.step_committed(self.step + 1)
            return (*result, lr)

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

    def _forward_backward_recovering(
        self, batches: list[Batch], target_share: torch.Tensor
    ) -> torch.Tensor:
        """forward_backward that survives out-of-memory errors (see distrain/train/oom.py)."""
        step = self.step + 1
        pipelined = self.dims.pp > 1
        # Collectives inside the forward (FSDP2, tp, pp, cp's key/value all-gather): the ranks
        # agree before each micro-batch.
        agree = self.dims.dp_wrapper == "fsdp" or pipelined or self.dims.cp > 1
        while True:
            hook = self.faults.out_of_memory_hook(step, 1 if pipelined else len(batches))
            if agree:
                # Every path below joins exactly one agreement per attempt after the last one
                # it passed, so the ranks' flag all-reduces pair up whoever failed where.
                try:
                    loss = self.model.forward_backward(
                        batches,
                        self.scaler.scale,
                        sync_each=True,
                        before_micro_batch=oom.agreed(hook, self.ctx.device),
                        target_share=target_share,
                    )
                    failed = False
                except oom.StepAbandoned:
                    failed = None  # agreed already, by every rank
                except torch.OutOfMemoryError:
                    failed = True  # inside a micro-batch (see oom.py on when that recovers)
                if failed is not None and not oom.any_rank_failed(failed, self.ctx.device):
                    return loss
            else:
                try:
                    loss = self.model.forward_backward(
                        batches,
                        self.scaler.scale,
                        sync=False,
                        before_micro_batch=hook,
                        target_share=target_share,
                    )
                    failed = False
                except torch.OutOfMemoryError:
                    failed = True
                if not oom.any_rank_failed(failed, self.ctx.device):
                    self.model.all_reduce_gradients(self.grad_group, self.cfg.comm.bucket_cap_mb)
                    return loss
            self.model.zero_grad()
            oom.free_memory(self.ctx.device)
            smaller = oom.halve_micro_batch(
                self.loader.micro_batch_size, step=step, logger=self.log
            )
            self.loader.set_micro_batch_size(smaller)
            batches = oom.split(batches, smaller)
            if pipelined:
                self.model.double_pipeline_microbatches()
            self.metrics.log({"step": step, "oom_retry_micro_batch_size": smaller})

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
        if self.replicas is not None:
            self.replicas.serve(self._live_state, self._load_live_state, step=self.step)
            self.replicas.quorum(step=self.step, loader=self.loader)
            self.replicas.check_restart_has_a_source(step=self.step)
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
            if self.replicas is None:
                lr = lr_at(self.step, cfg=self.cfg.optim, total_steps=t.steps)
                loss, grad_norm = self.train_step(
                    self.loader.next_batch(), lr, report_loss=is_logged(step)
                )
            else:
                loss, grad_norm, lr = self._replicated_step()
                step = self.step + 1  # a peer's step, where a failed attempt healed this group
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
                self.checkpointer.commit_ready()
            if stopping:
                self.faults.before_preempt_commit()
                self.checkpointer.wait()
                self.stop.close()
                raise Preempted(preempted_message(step, t.steps, self.stop.signal_name))
            if step % t.log_interval_steps == 0:
                window_start, window_steps = time.perf_counter(), 0
            for observer in self.observers:
                observer.step_end(step)
            if self.replicas is not None and not finished:
                self.replicas.quorum(step=self.step, loader=self.loader)
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
