"""Step time of a layout on this machine, from a probe of the rank's own work and the measured
collective costs (collectives.py): the model for layouts small enough to run here, where per-op
overhead and collective latency, not FLOPs, decide the step (timing.py's FLOP model is for
clusters).

- compute: one process runs this rank's real training step (the model built by
  `parallelize`, forward and backward over its micro-batches, gradient clipping, the
  optimizer step) under torch's fake process group of the planned world size, whose collectives
  return at once: the median of a few timed steps is the rank's compute with communication free.
  DDP cannot run on the fake group (its reducer needs a collective's result), so a DDP rank is
  probed as the unwrapped model on its local batch, the same work without the reducer. A rank
  of a layout whose ranks share this machine is probed by as many processes at once
  (`probe_together`): alone, a probe of a 2-rank layout's rank ran faster than the rank does
  while the other computes.
- communication: every collective that step issues, recorded from the dispatcher with its bytes
  and group size (DDP's bucketed all-reduce is counted from its bucket size instead), priced by
  the alpha-beta model. Nothing overlaps: on CPU a rank's collectives run on the thread, or
  against the core, that computes.
- pipeline (1 stage module per rank or more): each stage module is cut by `split_model` and its
  forward and backward of one microbatch timed alone, without the schedule; a schedule of m
  microbatches over p ranks with v stages each takes (m + (p - 1) / v) x the slowest rank's
  work per microbatch (the bubble), plus each microbatch's activation and its gradient crossing
  the stage boundary, plus the optimizer step.
The probe runs on the CPU at `threads` intra-op threads, which should be what each rank gets
(torchrun starts several ranks with 1); timing a GPU rank would need the device's own clock and
synchronization, which it does not do yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from distrain.optim.builder import build_optimizer
from distrain.parallel.comm_record import Collective, RecordCollectives
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext
from distrain.parallel.grad_norm import clip_grad_norm
from distrain.parallel.parallelize import parallelize
from distrain.parallel.run_plan import RunPlan
from distrain.plan.collectives import KINDS, LinkCost
from distrain.plan.memory import fake_world
from distrain.plan.planned import replanned


@dataclass(frozen=True)
class Probe:
    """One rank's step: compute seconds (communication free), its collectives, and for a
    pipeline the per-microbatch work that the bubble multiplies."""

    compute_s: float
    collectives: tuple[Collective, ...]
    pp: int = 1
    stages_per_rank: int = 1
    microbatches: int = 1
    microbatch_s: float = 0.0
    boundary_bytes: int = 0


@dataclass(frozen=True)
class ProbedTime:
    compute_s: float
    comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up: allocator, autograd graph caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(plan: RunPlan, *, threads: int = 1, repeats: int = 5) -> Probe:
    """The rank-0 step of the layout `plan` on this machine (see the module docstring). It runs
    on the CPU, where training.compile "auto" means eager (planned.py's `planned_run`)."""
    dims = plan.dims
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if dims.pp > 1:
            return _probe_pipeline(plan, repeats)
        if dims.dp_wrapper == "ddp":
            return _probe_ddp(plan, repeats)
        return _probe_fake_world(plan, repeats)
    finally:
        torch.set_num_threads(previous)


def probe_together(
    jobs: list[RunPlan], processes: int, *, threads: int = 1, repeats: int = 5
) -> list[Probe]:
    """`probe` of each layout of `jobs` as a machine running `processes` ranks sees it:
    `processes` fresh processes probe the same layouts at the same time (each keeps probing
    until all have finished, so none is timed alone), and each layout's compute is their mean.
    A rank shares the machine's caches, memory bandwidth and clock (on CPU, cores that may be
    hyper-threads of one another) with the other local ranks, which a probe alone does not."""
    spawn = mp.get_context("spawn")
    start, finished = spawn.Barrier(processes), spawn.Value("i", 0)
    queue = spawn.Queue()
    children = [
        spawn.Process(
            target=_probe_child, args=(jobs, threads, repeats, start, finished, queue, processes)
        )
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    found = [queue.get() for _ in children]
    for child in children:
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"a probe process failed (exit code {child.exitcode})")
    return [_mean_probe([probes[i] for probes in found]) for i in range(len(jobs))]


def _probe_child(
    jobs: list[RunPlan],
    threads: int,
    repeats: int,
    start: Any,
    finished: Any,
    queue: Any,
    processes: int,
) -> None:
    start.wait()
    found = [probe(plan, threads=threads, repeats=repeats) for plan in jobs]
    with finished.get_lock():
        finished.value += 1
    queue.put(found)
    while finished.value < processes:  # company for the probes still being timed
        for plan in jobs:
            probe(plan, threads=threads, repeats=1)
            if finished.value >= processes:
                break


def _mean_probe(probes: list[Probe]) -> Probe:
    return dataclasses.replace(
        probes[0],
        compute_s=statistics.mean(p.compute_s for p in probes),
        microbatch_s=statistics.mean(p.microbatch_s for p in probes),
    )


def _probe_fake_world(plan: RunPlan, repeats: int) -> Probe:
    cfg, dims = plan.config, plan.dims
    t, world_size = cfg.training, dims.world_size
    with fake_world(world_size):
        ctx = DistContext(
            rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"), backend="fake"
        )
        mesh, dp_mesh = dims.build_mesh("cpu")
        torch.manual_seed(t.seed)
        model = parallelize(plan, mesh, dp_mesh, ctx, CommStats())
        optimizers = [
            build_optimizer(part, cfg.optim, spec=plan.spec, dp_group=dp_mesh.get_group())
            for part in model.parts
        ]
        rows = t.global_batch_size // dims.dp_size
        tokens = torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long)
        batches = [(tokens, tokens)] * (rows // t.micro_batch_size)

        def step() -> None:
            model.forward_backward(batches, lambda loss: loss, report_loss=False)
            clip_grad_norm(model.parameters(), 1.0, holders=world_size)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        # Garbage from the fake collectives must not slow the timed steps with denormals.
        with _flush_denormals():
            compute = _median_time(step, repeats)
            with RecordCollectives() as recorded:
                step()
    # The time model prices the kinds it measured (plan/collectives.py's KINDS); expert
    # parallelism's all-to-all is not among them yet.
    return Probe(compute, tuple(c for c in recorded.found if c.kind in KINDS))


def _probe_ddp(plan: RunPlan, repeats: int) -> Probe:
    """A DDP rank: its data-parallel share of the batch alone on one rank, with DDP's bucketed
    all-reduces over the dp ranks."""
    cfg, dp, world_size = plan.config, plan.dims.dp_size, plan.dims.world_size
    t = cfg.training
    alone_plan = replanned(
        plan,
        world_size=1,
        training=dataclasses.replace(t, global_batch_size=t.global_batch_size // dp),
        parallel=dataclasses.replace(cfg.parallel, zero_stage=0, dp_replicate=-1, dp_shard=-1),
    )
    alone = _probe_fake_world(alone_plan, repeats)
    with torch.device("meta"):
        model = alone_plan.spec.build(alone_plan.model)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    bucket = int(cfg.comm.bucket_cap_mb * 2**20)
    buckets = [min(bucket, grad_bytes - start) for start in range(0, grad_bytes, bucket)]
    collectives = [Collective("all_reduce", b, dp) for b in buckets]
    collectives.append(Collective("all_reduce", 4, world_size))  # the gradient norm
    return Probe(alone.compute_s, tuple(collectives))


@contextlib.contextmanager
def _flush_denormals() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _probe_pipeline(plan: RunPlan, repeats: int) -> Probe:
    """Each stage's forward + backward of one microbatch and its optimizer step, timed alone."""
    from distrain.parallel.pipeline import split_model
    from distrain.parallel.stages import stage_ids_for_rank

    cfg, dims, spec = plan.config, plan.dims, plan.spec
    p, t = cfg.parallel, cfg.training
    num_stages = dims.pp * p.pp_stages_per_rank
    microbatches = p.pp_microbatches if p.pp_microbatches > 0 else plan.batch.accumulation
    rows = plan.batch.local // microbatches
    dim = spec.shape(plan.model).dim
    with torch.device("meta"):
        meta = spec.build(plan.model)
    stage_s, step_s = [], []
    tokens = torch.zeros(rows, t.seq_len, dtype=torch.long)
    hidden = torch.randn(rows, t.seq_len, dim)
    for stage_id in range(num_stages):
        stage = split_model(meta, stage_id, num_stages, spec=spec)
        stage.to_empty(device="cpu")
        spec.init_weights(stage, plan.model, t.seed)
        optimizer = build_optimizer(stage, cfg.optim, spec=spec)

        def fwd_bwd(stage: nn.Module = stage, stage_id: int = stage_id) -> None:
            x = tokens if stage_id == 0 else hidden.clone().requires_grad_()
            out = stage(x)
            if stage_id == num_stages - 1:
                (spec.loss(out, tokens) / tokens.numel()).backward()
            else:
                out.backward(torch.ones_like(out))

        stage_s.append(_median_time(fwd_bwd, repeats))
        step_s.append(_median_time(optimizer.step, repeats))
    per_rank = [
        sum(stage_s[s] for s in stage_ids_for_rank(r, dims.pp, p.pp_stages_per_rank, ""))
        for r in range(dims.pp)
    ]
    collectives = (
        Collective("broadcast", 4, dims.pp),  # the last stage's loss, reported every step
        Collective("all_reduce", 4, dims.world_size),  # the gradient norm
    )
    return Probe(
        compute_s=max(step_s),
        collectives=collectives,
        pp=dims.pp,
        stages_per_rank=p.pp_stages_per_rank,
        microbatches=microbatches,
        microbatch_s=max(per_rank),
        boundary_bytes=rows * t.seq_len * dim * 4,
    )


def predicted_time(probe: Probe, costs: dict[str, LinkCost], *, tokens_per_step: int) -> ProbedTime:
    """Step seconds of a probed layout with the calibrated collective costs."""
    comm = sum(costs[c.kind].seconds(c.nbytes, c.group_size) for c in probe.collectives)
    compute, bubble = probe.compute_s, 0.0
    if probe.pp > 1:
        # Each microbatch's activation and its gradient cross each of the rank's boundaries.
        crossings = 2 * probe.microbatches * probe.stages_per_rank
        comm += crossings * costs["send_recv"].seconds(probe.boundary_bytes, 2)
        pipelined = probe.microbatches * probe.microbatch_s
        bubble = (probe.pp - 1) / probe.stages_per_rank * probe.microbatch_s
        compute += pipelined
    step = compute + comm + bubble
    return ProbedTime(
        compute_s=compute,
        comm_s=comm,
        bubble_s=bubble,
        step_s=step,
        tokens_per_s=tokens_per_step / step if step > 0 else math.inf,
    )
