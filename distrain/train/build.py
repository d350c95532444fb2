"""Assembling a run: `build_trainer` builds, from the run's plan (its config resolved once by
resolve.py), every part the loop runs, in dependency order, each from its own section of the
resolved config: the device
mesh, the data and its loader, the parallel model, the optimizers, the automatic micro-batch
choice, DiLoCo's outer optimizer, the checkpointer and its policy, the metrics sink (with
rank 0's experiment trackers), the stop-signal agreement, fault injection, the step observers,
out-of-memory recovery (training.oom_recovery) and this group's seat among the replica groups
(fault_tolerance.replica_groups: torchft's manager). Nothing is built later, and nothing here
runs a step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from distrain.checkpoint.checkpointer import Checkpointer, SaveRecord, checkpoint_storage
from distrain.checkpoint.policy import CheckpointPolicy
from distrain.checkpoint.storage import Storage
from distrain.config.schema import CheckpointConfig
from distrain.data import DistributedBatchLoader, build_eval_sets, check_data_skew
from distrain.data.dataset import TokenDataset
from distrain.data.shard_store import Call
from distrain.data.sources import build_mixture
from distrain.ft.replica_groups import ReplicaGroups
from distrain.launch.preempt import StopAgreement, StopSignals
from distrain.launch.rundir import run_id
from distrain.models.registry import model_record
from distrain.observe import heartbeat
from distrain.observe.health import LossSpikes, NonFiniteGuard
from distrain.observe.metrics import MetricsWriter
from distrain.observe.observer import StepObserver
from distrain.observe.profiling import PhaseRanges, StepProfiler
from distrain.observe.progress import Progress
from distrain.observe.stragglers import Stragglers
from distrain.observe.trackers import Trackers, flat_params
from distrain.optim.builder import build_optimizers
from distrain.optim.diloco import outer_optimizer
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext, host_group
from distrain.parallel.mesh import ParallelDims, site_group
from distrain.parallel.model import ParallelModel
from distrain.parallel.parallelize import parallelize
from distrain.parallel.run_plan import RunPlan
from distrain.parallel.scaler import AgreedGradScaler
from distrain.train import autobatch
from distrain.train.fault_injection import FaultInjection
from distrain.train.loop import Trainer
from distrain.train.observers import (
    CommMetrics,
    DataMetrics,
    DiLoCoMetrics,
    MoEMetrics,
    ReplicaCheck,
)
from distrain.train.oom import OutOfMemoryRecovery
from distrain.train.rng import seed_everything


def build_trainer(plan: RunPlan, ctx: DistContext, logger: logging.Logger) -> Trainer:
    """Everything one rank trains with, for the run's `plan` (train/resolve.py) on this
    process's group (`ctx`). Collective: every rank calls it."""
    cfg, dims = plan.config, plan.dims
    run_dir = Path(cfg.run.dir)
    stop_signals = StopSignals(grace_s=cfg.checkpoint.preempt_grace_s, logger=logger)
    t = cfg.training
    mesh, dp_mesh = dims.build_mesh(ctx.device.type, timeout_s=cfg.comm.collective_timeout_s)
    dp_rank, dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    seed_everything(t.seed, deterministic=t.deterministic)

    train_set, val_set, loader = _data(plan, dp_rank, dp_group, ctx, logger)
    vocab_size = plan.spec.shape(plan.model).vocab_size
    eval_sets = build_eval_sets(cfg.data, t.seq_len, vocab_size=vocab_size)

    comm_stats = CommStats()
    model = parallelize(plan, mesh, dp_mesh, ctx, comm_stats)
    timeout_s = cfg.comm.collective_timeout_s
    site = site_group(mesh, timeout_s=timeout_s) if dims.diloco else None
    optimizers = build_optimizers(
        model.parts,
        cfg.optim,
        plan.spec,
        dims,
        mesh,
        dp_mesh,
        comm_stats,
        scaler=AgreedGradScaler(ctx.device, enabled=t.precision == "fp16"),
        total_steps=t.steps,
        counted_elsewhere=model.counted_elsewhere,
        site=site,
        logger=logger,
    )
    trackers = None
    if ctx.rank == 0:
        trackers = Trackers(
            cfg.metrics, run_dir, logger, params=flat_params(cfg.to_dict()), total_steps=t.steps
        )
    metrics = MetricsWriter(
        run_dir,
        enabled=ctx.rank == 0,
        tensorboard=cfg.metrics.tensorboard,
        sink=trackers or None,
    )
    if plan.auto_micro_batch:
        choice = autobatch.choose(
            model,
            optimizers.per_part,
            train_set,
            loader,
            training=t,
            debug=cfg.debug,
            ctx=ctx,
            logger=logger,
        )
        plan = plan.with_micro(choice.micro_batch_size)
        metrics.log(choice.metrics_row())
    # The preset's name, or under model.init_from the family and the folder it loads.
    named = cfg.model.preset
    if cfg.model.init_from:
        named = f"{plan.spec.name} from {cfg.model.init_from}"
    logger.info(
        "model %s: %.2fM parameters; layout %s; accumulation %d x micro-batch %d",
        named,
        plan.spec.num_params(plan.model) / 1e6,
        dims.describe(),
        plan.batch.accumulation,
        plan.batch.micro,
    )

    outer = None
    if dims.diloco:
        outer = outer_optimizer(
            cfg.diloco,
            dims,
            mesh,
            model,
            total_steps=t.steps,
            bucket_cap_mb=cfg.comm.bucket_cap_mb,
        )
    faults = FaultInjection(cfg.debug, rank=ctx.rank, logger=logger)
    checkpointer = _checkpointer(
        cfg.checkpoint, run_dir, model_record(cfg.model), dims, ctx, metrics, faults, logger
    )
    nonfinite = NonFiniteGuard(
        t.nonfinite, max_in_a_row=t.max_nonfinite_steps, rank=ctx.rank, world_size=ctx.world_size
    )
    phase_ranges = PhaseRanges(ctx.device)

    def counted() -> float:
        """The bytes counted where their collectives were issued: gradients', DiLoCo's."""
        outer_bytes = 0.0 if outer is None else outer.bytes_sent
        return comm_stats.snapshot()["bytes_sent"] + outer_bytes

    observers = _observers(
        plan,
        ctx,
        run_dir,
        model,
        mesh,
        comm_stats,
        nonfinite,
        metrics,
        phase_ranges,
        loader,
        logger,
        counted,
    )
    if outer is not None:
        observers.insert(observers.index(metrics), DiLoCoMetrics(outer))
    # The ranks gradients are averaged over: dp, or dp x cp under context parallelism.
    grad_group = dims.gradient_mesh(mesh, dp_mesh).get_group()
    oom = None
    if t.oom_recovery:
        oom = OutOfMemoryRecovery(
            model,
            optimizers.scale,
            loader,
            ctx=ctx,
            grad_group=grad_group,
            bucket_cap_mb=cfg.comm.bucket_cap_mb,
            faults=faults,
            metrics=metrics,
            logger=logger,
        )
    replicas = None
    if cfg.fault_tolerance.replica_groups:
        replicas = ReplicaGroups(
            cfg.fault_tolerance,
            ctx=ctx,
            dp_rank=dp_rank,
            dp_size=dims.dp_size,
            metrics=metrics,
            logger=logger,
        )
    return Trainer(
        plan=plan,
        ctx=ctx,
        log=logger,
        run_dir=run_dir,
        dp_rank=dp_rank,
        grad_group=grad_group,
        loader=loader,
        val_set=val_set,
        eval_sets=eval_sets,
        model=model,
        optimizers=optimizers,
        oom=oom,
        replicas=replicas,
        checkpointer=checkpointer,
        checkpoint_policy=CheckpointPolicy(cfg.checkpoint, total_steps=t.steps, device=ctx.device),
        stop_signals=stop_signals,
        stop=StopAgreement(stop_signals, host_group()),
        nonfinite=nonfinite,
        metrics=metrics,
        faults=faults,
        observers=observers,
        phase_ranges=phase_ranges,
        outer=outer,
    )


def _data(
    plan: RunPlan,
    dp_rank: int,
    dp_group: dist.ProcessGroup,
    ctx: DistContext,
    logger: logging.Logger,
) -> tuple[TokenDataset, TokenDataset, DistributedBatchLoader]:
    """The train and validation sets and this rank's loader over the global sample stream;
    ranks reading unequal shares are reported (or refused) by the skew check."""
    cfg = plan.config
    t = cfg.training

    def storage_call(url: str) -> Call:
        return Storage(url, retry_s=cfg.checkpoint.storage_retry_s).call

    mixture, val_set = build_mixture(
        cfg.data,
        t.seq_len,
        seed=t.seed,
        vocab_size=plan.spec.shape(plan.model).vocab_size,
        call_for=storage_call,
    )
    loader = DistributedBatchLoader(
        mixture,
        global_batch_size=plan.batch.global_batch,
        micro_batch_size=plan.batch.micro,
        dp_rank=dp_rank,
        dp_size=plan.batch.dp,
        seed=t.seed,
        prefetch_batches=cfg.data.prefetch_batches,
    )
    train_set = loader.dataset
    logger.info(
        "data: %d train / %d val sequences of %d tokens (%s); this rank reads %d per epoch",
        len(mixture),
        len(val_set),
        t.seq_len,
        ", ".join(
            f"{s.name} {s.weight / sum(x.weight for x in mixture.sources):.3g}"
            for s in mixture.sources
        ),
        loader.samples_per_rank_per_epoch,
    )
    check_data_skew(
        loader.samples_per_rank_per_epoch,
        max_skew=cfg.data.max_skew,
        action=cfg.data.skew_action,
        group=dp_group,
        logger=logger,
        device=ctx.device,
    )

    return train_set, val_set, loader


def _checkpointer(
    checkpoint: CheckpointConfig,
    run_dir: Path,
    model: dict[str, Any],
    dims: ParallelDims,
    ctx: DistContext,
    metrics: MetricsWriter,
    faults: FaultInjection,
    logger: logging.Logger,
) -> Checkpointer:
    """The checkpointer of this run's checkpoint settings and storage; each settled save is a
    metrics row (checkpoint_stall_s, checkpoint_write_s, checkpoint_bytes; checkpoint_failed and
    checkpoint_error for a failed one). `model`: what the manifests record of the model
    (models/registry.model_record)."""

    def checkpoint_settled(record: SaveRecord) -> None:
        row: dict[str, Any] = {
            "step": record.step,
            "checkpoint_stall_s": record.stall_s,
            "checkpoint_write_s": record.write_s,
            "checkpoint_bytes": record.bytes,
        }
        if record.error is not None:
            row.update(checkpoint_failed=1, checkpoint_error=record.error)
        metrics.log(row)

    c = checkpoint
    return Checkpointer(
        checkpoint_storage(c, str(run_dir)),
        run_id=run_id(run_dir),
        resume_from=c.resume_from,
        layout=dims.describe(),
        async_mode=c.async_mode,
        pinned_staging=ctx.device.type == "cuda",
        keep_temporary=c.keep_temporary,
        logger=logger,
        max_failed_saves=c.max_failed_saves,
        collective_timeout_s=c.collective_timeout_s,
        on_saved=checkpoint_settled,
        before_commit=faults.before_commit,
        model=model,
    )


def _observers(
    plan: RunPlan,
    ctx: DistContext,
    run_dir: Path,
    model: ParallelModel,
    mesh: DeviceMesh,
    comm_stats: CommStats,
    nonfinite: NonFiniteGuard,
    metrics: MetricsWriter,
    phase_ranges: PhaseRanges,
    loader: DistributedBatchLoader,
    logger: logging.Logger,
    counted: Callable[[], float],
) -> list[StepObserver]:
    """The step observers, in the order the loop calls them: the metrics row's producers,
    then the sink, then what reads the row. The profiler's phase ranges listen to the
    heartbeat when it profiles, and always on CUDA (named ranges for external profilers)."""
    cfg, t = plan.config, plan.training
    profiler = StepProfiler(
        cfg.profile,
        run_dir=run_dir,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        logger=logger,
    )
    if profiler.enabled or ctx.device.type == "cuda":
        heartbeat.listen(phase_ranges)
    observers: list[StepObserver] = [
        nonfinite,
        LossSpikes(t.loss_spike_factor),
        Stragglers(ctx.device, ratio=cfg.watchdog.straggler_ratio, rank=ctx.rank, logger=logger),
        CommMetrics(
            comm_stats,
            # Compiled code is not entered with the recording mode: it would recompile.
            record_layout=not t.compile and _layout_collectives(model.dims),
            counted=counted,
        ),
        DataMetrics(loader),
    ]
    if model.moe_stats is not None:
        observers.append(MoEMetrics(model.moe_stats))
    observers.append(metrics)
    if cfg.debug.check_replicas:
        observers.append(ReplicaCheck(model, mesh))
    observers += [
        Progress(total=t.steps, enabled=ctx.rank == 0 and cfg.metrics.progress_bar, logger=logger),
        profiler,
    ]
    return observers


def _layout_collectives(dims: ParallelDims) -> bool:
    """Whether the layout itself communicates in a step (FSDP2, tp, pp, cp), beyond the
    gradient collectives CommStats counts where they are issued."""
    return dims.dp_wrapper == "fsdp" or dims.tp > 1 or dims.pp > 1 or dims.cp > 1
