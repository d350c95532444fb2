"""The training loop: data -> forward/backward (accumulate, mixed precision) -> clip -> step -> log
-> evaluate -> checkpoint. Everything it trains with is built from the config in `Trainer.__init__`.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.checkpoint.checkpointer import (
    Checkpointer,
    checkpoint_storage,
    corrupt_one_shard,
    step_name,
)
from distrain.checkpoint.policy import CheckpointPolicy
from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader, build_datasets, check_data_skew, val_batches
from distrain.errors import CheckpointError
from distrain.launch.preempt import Preempted, StopAgreement, StopSignals, preempted_message
from distrain.launch.rundir import run_id
from distrain.layout.rules import validate as validate_layout
from distrain.models.presets import num_params
from distrain.models.registry import family_of
from distrain.observe import heartbeat
from distrain.observe.health import LossSpikes, NonFiniteGuard
from distrain.observe.metrics import MetricsWriter
from distrain.observe.profiling import PhaseRanges, StepProfiler
from distrain.observe.progress import Progress
from distrain.observe.stragglers import ComputeTimer, straggler_metrics
from distrain.optim.builder import (
    build_optimizers,
    lr_at,
    set_lr,
)
from distrain.optim.onebit_zero import named_gradients
from distrain.parallel.compress import CommStats
from distrain.parallel.data_parallel import (
    KeepsGradientsLocal,
    ShardsGradients,
    average_in_optimizers,
)
from distrain.parallel.grad_norm import clip_grad_norm
from distrain.parallel.mesh import DistContext, host_group, resolve_auto_choices
from distrain.parallel.model import build_parallel_model
from distrain.parallel.sanity import check_all_replicas
from distrain.parallel.scaler import AgreedGradScaler
from distrain.train import autobatch, oom
from distrain.train.faults import maybe_inject_failure, maybe_inject_hang, maybe_inject_nan
from distrain.train.rng import seed_everything
from distrain.train.state import ModelState, OptimizerState, RNGState

Batch = tuple[torch.Tensor, torch.Tensor]


class Trainer:
    def __init__(self, cfg: Config, ctx: DistContext, logger: logging.Logger):
        self.cfg, self.ctx, self.log = cfg, ctx, logger
        t = cfg.training
        resolve_auto_choices(t, ctx.device, logger)
        self.run_dir = Path(cfg.run.dir)
        self.stop_signals = StopSignals(grace_s=cfg.checkpoint.preempt_grace_s, logger=logger)
        layout = validate_layout(cfg, ctx.world_size)
        auto_batch = autobatch.defer_choice(t)
        self.dims, self.args = layout.dims, layout.model
        self.mesh, dp_mesh = self.dims.build_mesh(
            ctx.device.type, timeout_s=cfg.debug.collective_timeout_s
        )
        self.dp_rank, self.dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
        # The ranks gradients are averaged over: dp, or dp x cp under context parallelism.
        self.grad_group = self.dims.gradient_mesh(self.mesh, dp_mesh).get_group()
        seed_everything(t.seed, deterministic=t.deterministic)

        train_set, self.val_set = build_datasets(
            cfg.data, t.seq_len, vocab_size=self.args.vocab_size
        )
        self.loader = DistributedBatchLoader(
            train_set,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp_size,
            seed=t.seed,
        )
        logger.info(
            "data: %d train / %d val sequences of %d tokens; this rank reads %d per epoch",
            len(train_set),
            len(self.val_set),
            t.seq_len,
            self.loader.samples_per_rank_per_epoch,
        )
        check_data_skew(
            self.loader.samples_per_rank_per_epoch,
            max_skew=cfg.data.max_skew,
            action=cfg.data.skew_action,
            group=self.dp_group,
            logger=logger,
            device=ctx.device,
        )

        self.comm_stats = CommStats()
        self.model = build_parallel_model(
            self.args,
            cfg,
            self.dims,
            self.mesh,
            dp_mesh,
            ctx,
            self.comm_stats,
            spec=family_of(self.args),
        )
        self.optimizers = build_optimizers(
            self.model.parts, cfg.optim, self.dims, self.mesh, dp_mesh, self.comm_stats
        )
        self.auto_batch = (
            autobatch.choose(self.model, self.optimizers, train_set, self.loader, cfg, ctx, logger)
            if auto_batch
            else None
        )
        self.scaler = AgreedGradScaler(ctx.device, enabled=t.precision == "fp16")
        self.fp16_skipped = 0
        """Steps the loss scaler skipped (gradients overflowed on some rank)."""
        self.step = 0
        self.started = False
        """True once the loop begins: an error before that is a failed start (see worker.py)."""
        self.step_state = {"step": torch.zeros((), dtype=torch.int64)}
        logger.info(
            "model %s: %.2fM parameters; layout %s; accumulation %d x micro-batch %d",
            cfg.model.preset,
            num_params(self.args) / 1e6,
            self.dims.describe(),
            self.loader.accum_steps,
            t.micro_batch_size,
        )
        self.injected_oom = oom.InjectedOOM(cfg.debug, ctx.rank)
        self.checkpointer = Checkpointer(
            checkpoint_storage(cfg),
            run_id=run_id(self.run_dir),
            resume_from=cfg.checkpoint.resume_from,
            layout=self.dims.describe(),
            async_mode=cfg.checkpoint.async_mode == "async",
            keep_temporary=cfg.checkpoint.keep_temporary,
            logger=logger,
            max_failed_saves=cfg.checkpoint.max_failed_saves,
            collective_timeout_s=cfg.checkpoint.collective_timeout_s,
            on_failure=self._checkpoint_failed,
        )
        self.checkpoint_policy = CheckpointPolicy(
            cfg.checkpoint, total_steps=t.steps, device=ctx.device
        )
        self.metrics = MetricsWriter(
            self.run_dir, enabled=ctx.rank == 0, tensorboard=cfg.metrics.tensorboard
        )
        if self.auto_batch is not None:
            self.metrics.log(self.auto_batch.metrics_row())
        self.stop = StopAgreement(self.stop_signals, host_group())
        self.nonfinite = NonFiniteGuard(
            t.nonfinite,
            max_in_a_row=t.max_nonfinite_steps,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
        self.loss_spikes = LossSpikes(t.loss_spike_factor)
        self.compute_timer = ComputeTimer(ctx.device)
        heartbeat.listen(self.compute_timer)
        self.profiler = StepProfiler(
            cfg.profile,
            run_dir=self.run_dir,
            rank=ctx.rank,
            world_size=ctx.world_size,
            device=ctx.device,
            logger=logger,
        )
        self.phase_ranges = PhaseRanges(ctx.device)
        if self.profiler.enabled or ctx.device.type == "cuda":
            heartbeat.listen(self.phase_ranges)

    # --- checkpoints -------------------------------------------------------------------------

    def _state(self) -> dict:
        state = {
            "model": ModelState(self.model.parts),
            "optim": OptimizerState(self.model.parts, self.optimizers),
            "trainer": self.step_state,
            "data": self.loader,
            "rng": RNGState(),
        }
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler
        return state

    def save_checkpoint(self, kind: str | None, *, preempt: bool = False) -> None:
        """Save this step's checkpoint: `kind` is what the policy made due ("permanent",
        "temporary" or None); `preempt` marks the save a stop signal asked for."""
        self.step_state["step"].fill_(self.step)
        self.checkpointer.save(
            self.step, self._state(), permanent=kind == "permanent", preempt=preempt
        )
        if self.cfg.debug.corrupt_checkpoint_step == self.step:
            self.checkpointer.wait()
            if self.ctx.rank == 0:
                damaged = corrupt_one_shard(self.checkpointer.storage, self.step)
                self.log.warning("debug.corrupt_checkpoint_step: damaged %s", damaged)

    def _checkpoint_failed(self, step: int, message: str) -> None:
        self.metrics.log({"step": step, "checkpoint_failed": 1, "checkpoint_error": message})

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
        `ParallelModel.forward_backward`): for steps that are not logged."""
        local = any(
            isinstance(o, KeepsGradientsLocal) and o.keeps_gradients_local()
            for o in self.optimizers
        )
        if self.cfg.training.oom_recovery:
            loss = self._forward_backward_recovering(batches)
        else:
            loss = self.model.forward_backward(
                batches, self.scaler.scale, sync=not local, report_loss=report_loss
            )
        heartbeat.mark("optimizer")
        maybe_inject_nan(self.cfg.debug, self.step + 1, self.ctx.rank, self.model.parameters)
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        average_in_optimizers(self.optimizers)  # 1-bit Adam under tp/pp: its warm-up average
        max_norm, owner = self.cfg.optim.max_grad_norm or math.inf, self.optimizers[0]
        if isinstance(owner, ShardsGradients) and owner.shards_gradients:  # 1-bit ZeRO-2, no pp
            grad_norm = owner.reduce_and_clip(max_norm)
        else:
            grad_norm = clip_grad_norm(
                self.model.parameters(),
                max_norm,
                holders=1 if local else self.ctx.world_size // self.dims.pp,
                local=local,
                counted_elsewhere=self.model.counted_elsewhere,
            )
        update = self.scaler.is_enabled() or self.nonfinite.step_ok(
            grad_norm,
            step=self.step + 1,
            named_params=named_gradients(self.model.parts, owner),
            agreed=not local,
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

    def _forward_backward_recovering(self, batches: list[Batch]) -> torch.Tensor:
        """forward_backward that survives out-of-memory errors (see distrain/train/oom.py)."""
        step = self.step + 1
        pipelined = self.dims.pp > 1
        # Collectives inside the forward (FSDP2, tp, pp, cp's key/value all-gather): the ranks
        # agree before each micro-batch.
        agree = self.dims.dp_wrapper == "fsdp" or pipelined or self.dims.cp > 1
        while True:
            hook = self.injected_oom.hook(step, 1 if pipelined else len(batches))
            if agree:
                # Every path below joins exactly one agreement per attempt after the last one
                # it passed, so the ranks' flag all-reduces pair up whoever failed where.
                try:
                    loss = self.model.forward_backward(
                        batches,
                        self.scaler.scale,
                        sync_each=True,
                        before_micro_batch=oom.agreed(hook, self.ctx.device),
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
                        batches, self.scaler.scale, sync=False, before_micro_batch=hook
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

    def _comm_metrics(self, steps: int) -> dict[str, float]:
        """This rank's gradient-communication cost per step over the logging window, counted
        where each collective was issued (DDP hook, 1-bit Adam); none without data parallelism
        through DDP."""
        snap = self.comm_stats.snapshot()
        self.comm_stats.reset()
        if not snap["fp32_equivalent_bytes"]:
            return {}
        row = {
            "comm_bytes": snap["bytes_sent"] / steps,
            "comm_fp32_bytes": snap["fp32_equivalent_bytes"] / steps,
            "comm_compression_ratio": snap["compression_ratio"],
        }
        # Only hooks and 1-bit Adam time their collectives; DDP's plain all-reduce is counted
        # from its bucket sizes, untimed, so a window without a timed collective reports none.
        if snap["inflight_s"]:
            row["comm_inflight_s"] = snap["inflight_s"] / steps
        return row

    def _world_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over all ranks: every tp and pp rank of a replica holds its replica's value, so
        this is the data-parallel mean (gloo has no AVG op, so SUM / size)."""
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values / self.ctx.world_size

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over a fixed set of batches; leaves the model in train mode."""
        self.model.train(False)
        batches = val_batches(
            self.val_set,
            num_batches=self.cfg.training.eval_batches,
            micro_batch_size=self.cfg.training.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp_size,
        )
        loss = self.model.eval_loss(batches)
        self.model.train(True)
        return float(self._world_mean(loss))

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        t = self.cfg.training
        heartbeat.mark("checkpoint")
        if self.ctx.rank == 0:
            self.checkpointer.storage.check_writable()
        self.maybe_resume()
        self.checkpointer.claim_location()
        if self.step >= t.steps:
            self.log.info(
                "run already finished at step %d (training.steps = %d)", self.step, t.steps
            )
            return
        tokens_per_step = t.global_batch_size * t.seq_len
        self.started = True
        self.metrics.start(self.step)
        bar = Progress(
            total=t.steps,
            initial=self.step,
            enabled=self.ctx.rank == 0 and self.cfg.metrics.progress_bar,
            logger=self.log,
        )
        self.model.train(True)
        window_start, window_steps = time.perf_counter(), 0
        while self.step < t.steps:
            maybe_inject_failure(self.cfg.debug, self.step + 1, self.ctx.rank, self.log)
            self.profiler.before_step(self.step + 1)
            heartbeat.mark("data", step=self.step + 1)
            if self.cfg.debug.slow_rank == self.ctx.rank:
                time.sleep(self.cfg.debug.slow_ms / 1000)
            maybe_inject_hang(
                self.cfg.debug, self.step + 1, self.ctx.rank, self.model.parameters, self.log
            )
            lr = lr_at(self.step, cfg=self.cfg.optim, total_steps=t.steps)
            logged = (self.step + 1) % t.log_interval_steps == 0 or self.step + 1 == t.steps
            loss, grad_norm = self.train_step(self.loader.next_batch(), lr, report_loss=logged)
            self.step += 1
            window_steps += 1
            bar.update(1)
            finished = self.step == t.steps
            if self.step % t.log_interval_steps == 0 or finished:
                heartbeat.mark("log")
                loss_value, norm_value = self._world_mean(torch.stack([loss, grad_norm])).tolist()
                elapsed = time.perf_counter() - window_start
                row = {
                    "step": self.step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": norm_value,
                    "tokens_per_s": tokens_per_step * window_steps / elapsed,
                    "step_time_s": elapsed / window_steps,
                    "nonfinite_skipped": self.nonfinite.skipped,
                    "loss_spike": self.loss_spikes.update(loss_value),
                    **self._straggler_metrics(window_steps),
                    **self._comm_metrics(window_steps),
                    **(self.model.moe_stats.metrics() if self.model.moe_stats else {}),
                }
                if self.scaler.is_enabled():
                    row.update(loss_scale=self.scaler.get_scale(), fp16_skipped=self.fp16_skipped)
                self.metrics.log(row)
                if self.cfg.debug.check_replicas:
                    check_all_replicas(self.model, self.mesh)
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            # Agreed by every rank for this step (see launch/preempt.py); the last step just
            # finishes.
            stopping = not finished and self.stop.stop_now()
            if not stopping and (
                (t.eval_interval_steps and self.step % t.eval_interval_steps == 0) or finished
            ):
                heartbeat.mark("eval")
                val_loss = self.evaluate()
                self.metrics.log({"step": self.step, "val_loss": val_loss})
                self.log.info("step %d: val_loss %.4f", self.step, val_loss)
            log_step = self.step % t.log_interval_steps == 0 or finished
            kind = self.checkpoint_policy.due(self.step, sync_point=log_step)
            if kind is not None or stopping:
                heartbeat.mark("checkpoint")
                self.save_checkpoint(kind, preempt=stopping)
            if log_step:
                self.checkpointer.commit_ready()
            if stopping:
                bar.close()
                if self.cfg.debug.preempt_delay_s:
                    self.log.warning(
                        "debug.preempt_delay_s: waiting %.1fs before committing",
                        self.cfg.debug.preempt_delay_s,
                    )
                    time.sleep(self.cfg.debug.preempt_delay_s)
                self.checkpointer.wait()
                self.stop.close()
                raise Preempted(preempted_message(self.step, t.steps, self.stop.signal_name))
            if self.step % t.log_interval_steps == 0:
                window_start, window_steps = time.perf_counter(), 0
            self.profiler.after_step(self.step)
        bar.close()
        heartbeat.mark("checkpoint")
        self.checkpointer.wait()
        self.stop.close()
        newest = self.checkpointer.newest_committed
        self.log.info(
            "finished %d steps (newest committed checkpoint: %s)",
            self.step,
            "none" if newest is None else step_name(newest),
        )

    def _straggler_metrics(self, steps: int) -> dict[str, float | int]:
        found = straggler_metrics(self.compute_timer.take() / steps, self.ctx.device)
        if found["straggler_ratio"] > self.cfg.debug.straggler_ratio and self.ctx.rank == 0:
            self.log.warning(
                "straggler: rank %d computes %.2fx the median rank (%.3f s per step in data "
                "and forward)",
                found["slowest_rank"],
                found["straggler_ratio"],
                found["compute_s_max"],
            )
        return found

    def close(self) -> None:
        self.profiler.stop()
        self.phase_ranges.close()
        heartbeat.unlisten(self.compute_timer)
        heartbeat.unlisten(self.phase_ranges)
        self.metrics.close()
        self.stop_signals.close()
