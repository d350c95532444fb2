"""Running a model laid out in parallel (parallelize.py lays it out): `ParallelModel` hides what
differs between layouts from the trainer: how micro-batches run (accumulation loop or pipeline
schedule), how gradient sync is deferred, and which loss context (vocab-parallel under tp) wraps
forward and backward.

The training loss is the mean over the targets of the whole global batch: each micro-batch's
summed loss is divided by one step-wide `target_share` (the global batch's targets per rank that
averages gradients), so the gradients are the same whatever the micro-batch, accumulation,
pipeline or data-parallel split, also when samples hold unequal numbers of targets (document
masking leaves out the first token of every document; a negative target is no target).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from distrain.config.batch import BatchSizes
from distrain.data.dataset import Batch
from distrain.family.spec import ModelSpec
from distrain.observe import heartbeat
from distrain.parallel.compress import CommStats
from distrain.parallel.context import SequenceSplit
from distrain.parallel.data_parallel import (
    allreduce_payload,
    settle_bucket_layout,
)
from distrain.parallel.local import copy_from_flat
from distrain.parallel.mesh import ParallelDims
from distrain.parallel.moe_stats import MoEStats
from distrain.parallel.tensor import tp_loss_context
from distrain.parallel.tied import TiedEmbedding


@dataclass(frozen=True)
class DDPSettling:
    """What a DDP-wrapped model part needs once built: the shape of the throwaway batch that
    settles its buckets, and the communication hook installed after it (`install_hook` returns
    whether it installed one)."""

    rows: int
    seq_len: int
    install_hook: Callable[[DistributedDataParallel], bool]


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    return loss


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class ParallelModel:
    """The model parts this rank holds (one, or one per pipeline stage) and how to run them."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        dims: ParallelDims,
        mesh: DeviceMesh,
        batch: BatchSizes,
        precision: str,
        pp_schedule: str,
        device: torch.device,
        stage_ids: list[int],
        num_stages: int,
        pp_microbatches: int,
        spec: ModelSpec,
        comm_stats: CommStats,
        loss_in_model: bool = False,
        tied: tuple[dist.ProcessGroup, tuple[str, str]] | None = None,
        moe_stats: MoEStats | None = None,
        ddp: DDPSettling | None = None,
    ):
        """`spec`: the model family's (its loss: (output, targets) -> summed loss).
        `comm_stats`: where DDP's plain all-reduce is counted (the other gradient collectives
        count themselves). `loss_in_model`: the model part computes the loss itself (its
        forward with targets, a family's `loss_in_forward`): when it is compiled whole, so that
        the loss joins its graph. `tied`: the group of the first and last pipeline rank and the
        names of a weight the two share (`TiedEmbedding`). `moe_stats`: a mixture-of-experts
        model's statistics, whose balancing losses join the training loss. `ddp`: the part is
        DDP-wrapped, its buckets settled and its hook installed here (`DDPSettling`)."""
        self.parts, self.dims, self.device = parts, dims, device
        self.spec = spec
        self.loss_fn = spec.loss
        self.stage_ids, self.num_stages = stage_ids, num_stages
        self.train_batch_rows = batch.local
        self.precision = precision
        # FSDP2 applies bf16 through its mixed-precision policy; DDP through autocast.
        self.autocast = precision_context(
            "fp32" if dims.dp_wrapper == "fsdp" and self.precision == "bf16" else self.precision,
            device,
        )
        self.loss_in_model = loss_in_model
        # Under context parallelism each rank runs its share of every sequence's columns.
        self.sequence_split = SequenceSplit(mesh["cp"]) if dims.cp > 1 else None
        self.runner = None
        self.tied: TiedEmbedding | None = None
        self._pp_mesh = mesh["pp"] if dims.pp > 1 else None
        self._pp_schedule = pp_schedule
        if dims.pp > 1:
            self._build_runner(pp_microbatches)
            if tied is not None:
                group, names = tied
                self.tied = TiedEmbedding(parts, stage_ids, num_stages, group, names=names)
        # The settling iteration below counts no bytes and feeds no MoE statistics.
        self.comm_stats: CommStats | None = None
        self.moe_stats: MoEStats | None = None
        self.allreduce_payload: tuple[int, int] | None = None
        """(elements, bytes) of DDP's built-in all-reduce per synchronized step, counted here
        because no hook runs on that path (see `install_comm_hook`); None when a hook counts."""
        if ddp is not None:
            self.allreduce_payload = self._settle_ddp(ddp)
        self.comm_stats, self.moe_stats = comm_stats, moe_stats
        if moe_stats is not None and dims.pp > 1:
            from distrain.parallel.moe_pipeline import join_balancing_losses

            join_balancing_losses(parts, moe_stats)

    def _settle_ddp(self, ddp: DDPSettling) -> tuple[int, int] | None:
        """DDP's buckets settled by one throwaway forward/backward (so a restarted process
        reduces exactly as the run it continues), then its communication hook installed; the
        payload of DDP's plain all-reduce when no hook was installed (the model counts it)."""
        (wrapped,) = self.parts
        tokens = torch.zeros(ddp.rows, ddp.seq_len, dtype=torch.long, device=self.device)
        settle_bucket_layout(wrapped, lambda: self.forward_backward([(tokens, tokens)], _unscaled))
        return None if ddp.install_hook(wrapped) else allreduce_payload(wrapped)

    def _build_runner(self, n_microbatches: int) -> None:
        from distrain.parallel.pipeline import PipelineRunner

        self.runner = PipelineRunner(
            self.parts,
            stage_ids=self.stage_ids,
            num_stages=self.num_stages,
            pp_mesh=self._pp_mesh,
            schedule=self._pp_schedule,
            n_microbatches=n_microbatches,
            device=self.device,
            loss_fn=self.loss_fn,
        )

    def double_pipeline_microbatches(self) -> int:
        """Run the local batch in twice as many, half as large, pipeline microbatches from now
        on (OOM recovery); a new schedule, since one runs a single microbatch shape. Returns the
        new count; every pp rank must call it at the same step."""
        assert self.runner is not None
        doubled = self.runner.n_microbatches * 2
        if self.train_batch_rows % doubled:
            raise ValueError(
                f"a local batch of {self.train_batch_rows} sequences does not split into "
                f"{doubled} pipeline microbatches"
            )
        self._build_runner(doubled)
        return doubled

    def fit_pipeline_batch(self, rows: int) -> None:
        """Run a local batch of `rows` sequences from now on, in microbatches of the size the
        schedule runs now: replica groups (ft/replica_groups.py) re-split the global batch
        when a group leaves or joins, so the survivors' local batch grows or shrinks. A new
        schedule when the count changes, since one runs a single batch shape; every pp rank
        of the group calls it at the same step (their loaders are re-planned alike). The
        step's math is unchanged: each microbatch's loss is divided by the step's target
        share whatever their count (pipeline.py)."""
        assert self.runner is not None
        if rows == self.train_batch_rows:
            return
        microbatch = self.train_batch_rows // self.runner.n_microbatches
        if rows % microbatch:
            raise ValueError(
                f"a local batch of {rows} sequences does not split into pipeline microbatches "
                f"of {microbatch}"
            )
        self.train_batch_rows = rows
        self._build_runner(rows // microbatch)

    def loss_context(self) -> contextlib.AbstractContextManager:
        return tp_loss_context(self.dims.tp > 1)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    @property
    def counted_elsewhere(self) -> list[nn.Parameter]:
        """Parameters whose gradient another rank's copy already counts in the global norm (a
        tied head on the last pipeline stage)."""
        return self.tied.counted_elsewhere if self.tied is not None else []

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """Defer the gradient all-reduce / reduce-scatter to the last micro-batch."""
        part = self.parts[0]
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if last or not hasattr(part, "no_sync"):
            return contextlib.nullcontext()
        return part.no_sync()

    def target_share(
        self, batches: list[Batch], group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """What this step's summed losses are divided by: the targets (non-negative ones) of the
        whole global batch per rank that averages gradients, an fp32 device scalar. Counted
        from the batches before any forward (every cp rank holds whole sequences, hence the
        division by cp). With `group`, the ranks gradients are averaged over, the counts are
        summed over it (one all-reduce of an int64 scalar, no host sync); without, this rank's
        count stands for every rank's: exact when no target is masked."""
        count = torch.stack([(b[1] >= 0).sum() for b in batches]).sum().to(self.device)
        ranks = 1
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(count, group=group)
            ranks = dist.get_world_size(group)
        return (count.double() / (ranks * self.dims.cp)).float()

    def forward_backward(
        self,
        batches: list[Batch],
        scale: Callable[[torch.Tensor], torch.Tensor],
        *,
        sync: bool = True,
        before_micro_batch: Callable[[int], None] | None = None,
        report_loss: bool = True,
        sync_each: bool = False,
        target_share: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; this rank's share of the step's
        loss (a device tensor): its summed loss / `target_share` (default: `target_share`
        without a group), whose mean over the ranks is the global batch's mean loss.
        With sync=False no gradient leaves the rank: `all_reduce_gradients` must follow (DDP
        layouts only).

        Under pp only the last stage computes the loss; with report_loss it is broadcast to the
        other pp ranks (a collective that makes every stage wait for the last one), so that every
        rank returns it. Without, a rank that does not hold the last stage returns zero: pass
        report_loss=False only for a step whose loss nobody reads.

        sync_each: synchronize the gradients after every micro-batch, so that abandoning the
        step between micro-batches leaves nothing pending in FSDP2 (OOM recovery). Under pp,
        whose schedule runs all micro-batches in one call, `before_micro_batch(0)` runs once,
        before the schedule.
        """
        if target_share is None:
            target_share = self.target_share(batches)
        if self.runner is not None:
            if before_micro_batch is not None:
                before_micro_batch(0)
            inputs, targets, documents = self._pipeline_batch(batches)
            self.fit_pipeline_batch(len(inputs))
            heartbeat.mark("forward_backward")
            with self.loss_context(), self.autocast:
                loss = self.runner.train_step(
                    inputs, targets, scale, loss_divisor=target_share, documents=documents
                )
            if self.tied is not None:
                self.tied.sum_gradients()
            local = _full_tensor(loss) if loss is not None else None
            if report_loss:
                return self.runner.broadcast_loss(local)
            return local if local is not None else torch.zeros((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            if before_micro_batch is not None:
                before_micro_batch(i)
            last = sync and i == len(batches) - 1
            with self._sync_context(last or sync_each), self.loss_context():
                heartbeat.mark("forward")
                loss = self._loss(batch) / target_share
                # The reported loss stays the cross-entropy; MoE balancing terms only train
                # (each micro-batch's term weighs 1 / micro-batches, as before the division
                # by targets).
                total = (
                    loss
                    if self.moe_stats is None
                    else loss + _as_loss(loss, self.moe_stats.after_forward() / len(batches))
                )
                heartbeat.mark("backward")
                scale(total).backward()
            loss_sum += _full_tensor(loss.detach())
        if sync and self.allreduce_payload is not None:
            # With sync_each (OOM recovery under cp) DDP all-reduced after every micro-batch.
            for _ in range(len(batches) if sync_each else 1):
                self._count_allreduce(*self.allreduce_payload)
        return loss_sum

    def _pipeline_batch(
        self, batches: list[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, documents) of the whole local batch on the device: this rank's
        columns of the inputs and targets under context parallelism (the stages get their
        positions from `apply_context_parallel`'s hook), the document ids of whole sequences."""
        parts = (torch.cat(part).to(self.device) for part in zip(*batches, strict=True))
        inputs, targets, *documents = parts
        if self.sequence_split is not None:
            inputs, targets, _ = self.sequence_split.shard(inputs, targets)
        return inputs, targets, documents[0] if documents else None

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the single model part, and the targets they predict (this rank's share
        of the sequence under context parallelism), on the device."""
        inputs, targets, kwargs = self._model_inputs(batch)
        with self.autocast:
            return self.parts[0](inputs, **kwargs), targets

    def _model_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(inputs, targets, the model's keyword arguments) of one micro-batch on the device:
        under context parallelism this rank's columns and their positions; with document ids,
        those of the whole sequences."""
        inputs, targets, *documents = (t.to(self.device, non_blocking=True) for t in batch)
        kwargs: dict[str, Any] = {}
        if self.sequence_split is not None:
            inputs, targets, kwargs["positions"] = self.sequence_split.shard(inputs, targets)
        if documents:
            kwargs["documents"] = documents[0]
        return inputs, targets, kwargs

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The summed training loss of one micro-batch (the single model part's)."""
        if self.loss_in_model:
            inputs, targets, kwargs = self._model_inputs(batch)
            with self.autocast:
                return self.parts[0](inputs, targets=targets, **kwargs)
        return self.loss_fn(*self._forward(batch))

    def _count_allreduce(self, numel: int, nbytes: int) -> None:
        """Count an uncompressed all-reduce of `numel` elements in `nbytes`; no hook issued it,
        so no time is taken (comm_inflight_s stays a figure of timed collectives)."""
        if self.comm_stats is not None:
            self.comm_stats.add_untimed_all_reduce(
                nbytes, fp32_values=numel, group_size=self.dims.dp_size * self.dims.cp
            )

    @torch.no_grad()
    def all_reduce_gradients(self, dp_group: dist.ProcessGroup, bucket_mb: float) -> None:
        """Average gradients over the data-parallel group in flat buckets, as DDP would have in
        the last backward (used when that backward ran without sync)."""
        size = dist.get_world_size(dp_group)
        if size == 1:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        limit = max(1, int(bucket_mb * 2**20) // 4)
        bucket: list[torch.Tensor] = []
        for i, grad in enumerate(grads):
            bucket.append(grad)
            if sum(g.numel() for g in bucket) >= limit or i == len(grads) - 1:
                flat = torch.cat([g.flatten() for g in bucket])
                dist.all_reduce(flat, group=dp_group)
                self._count_allreduce(flat.numel(), flat.nbytes)
                flat /= size
                copy_from_flat(flat, bucket)
                bucket = []

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def eval_loss(self, batches: list[Batch]) -> torch.Tensor:
        """(summed loss, targets) [2] over this rank's share of `batches` (its columns under
        context parallelism), fp32 on the device: their sums over the ranks give the mean."""
        # A compiled model's training graph does not serve no_grad calls: rather than compile a
        # second, inference graph (as long as the first when cold) for a few batches, run
        # eagerly. The stance is set per call, so importing this module imports no dynamo.
        with torch.compiler.set_stance("eager_on_recompile"), torch.no_grad():
            return self._eval_loss(batches)

    def _eval_loss(self, batches: list[Batch]) -> torch.Tensor:
        if self.runner is not None:
            return self._pipeline_eval_loss(batches)
        total = torch.zeros(2, device=self.device)
        for batch in batches:
            with self.loss_context():
                logits, targets = self._forward(batch)
                total[0] += _full_tensor(self.loss_fn(logits, targets))
                total[1] += (targets >= 0).sum()
        return total

    def _pipeline_eval_loss(self, batches: list[Batch]) -> torch.Tensor:
        """A pipeline schedule runs one batch shape only: regroup the evaluation samples into
        training-sized batches (the validation set is whole global batches, so this rank's
        share is whole local batches)."""
        inputs, targets, documents = self._pipeline_batch(batches)
        size = self.train_batch_rows
        chunks = len(inputs) // size
        total = torch.zeros(2, device=self.device)
        for i in range(chunks):
            rows = slice(i * size, (i + 1) * size)
            with self.loss_context(), self.autocast:
                loss = self.runner.eval_loss(
                    inputs[rows],
                    targets[rows],
                    loss_divisor=1.0,
                    documents=None if documents is None else documents[rows],
                )
            total[0] += self.runner.broadcast_loss(_full_tensor(loss) if loss is not None else None)
            total[1] += (targets[rows] >= 0).sum()
        return total


def _as_loss(loss: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """`term` in the loss's kind: under tp the loss is a Replicate DTensor, and a term every tp
    rank computed alike (the MoE balancing losses: MoE layers run replicated over tp) joins
    it as a Replicate DTensor too."""
    if isinstance(loss, DTensor):
        return DTensor.from_local(term, loss.device_mesh, loss.placements, run_check=False)
    return term


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t`: a DTensor gathered from its mesh (a Replicate loss only drops its
    wrapper), or `t` itself; parallel/local.py's `local_tensor` is this rank's shard instead."""
    return t.full_tensor() if isinstance(t, DTensor) else t
