"""The memory rows of `distrain plan` that fake builds price: a layout's bytes per rank from
estimate_memory (memory.py) or, for a pipeline, estimate_pipeline_memory (pipeline_memory.py) of
the first rank of each distinct stage (`memory_row`), shared between layouts that differ only in
the micro-batch; the wrappers that do not build on fake tensors (DDP, ZeroRedundancyOptimizer,
1-bit Adam's own sharding) planned from the build they wrap (`memory_of`); and a deep model's row
extrapolated from two shallow builds (`built_row`). Builds are read from and kept in a BuildStore
when one is given; `kept` and `build_key` let plan's build workers share them (build_sharing.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distrain.config.schema import ParallelConfig, TrainingConfig
from distrain.family.spec import ModelShape
from distrain.optim.capability import held_state_bytes, optimizer_capability
from distrain.parallel.run_plan import RunPlan
from distrain.parallel.stages import stage_ids_for_rank, stage_layer_ranges
from distrain.plan.build_results import MemoryEstimate, PipelineMemory, accumulates, at_depth
from distrain.plan.build_store import BuildStore, build
from distrain.plan.memory_model import (
    calibration_depths,
    family_of,
    with_depth,
    zero1_largest_share,
)
from distrain.plan.planned import replanned


def estimate_memory(plan: RunPlan, *, rank: int = 0) -> MemoryEstimate:
    """memory.py's fake build of a step. The builds import the training stack (DTensor, FSDP2,
    the optimizers: seconds) when one is made, not when a plan reads them all from its store."""
    from distrain.plan import memory

    return memory.estimate_memory(plan, rank=rank)


def estimate_pipeline_memory(plan: RunPlan, *, rank: int = 0) -> PipelineMemory:
    """pipeline_memory.py's fake build of a pp rank (imported when made, as `estimate_memory`)."""
    from distrain.plan import pipeline_memory

    return pipeline_memory.estimate_pipeline_memory(plan, rank=rank)


def cached(cache: dict, key: tuple, compute: Callable[[], Any]) -> Any:
    """cache[key], computed once; a build that failed fails again at once, with its error."""
    if key not in cache:
        try:
            cache[key] = compute()
        except Exception as error:  # noqa: BLE001 - the layout's row reports it (plan)
            cache[key] = error
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


def memory_of(
    plan: RunPlan,
    cache: dict,
    *,
    exhaustive: bool = False,
    store: BuildStore | None = None,
) -> MemoryEstimate:
    """estimate_memory of the layout `plan`, shared between candidates that differ only in the
    micro-batch.

    Two wrappers read tensor data while they are built, so they cannot run on fake tensors, and
    are planned from the build they wrap: DDP (its C++ reducer checks parameter values across
    ranks) holds what the unwrapped model holds, its gradients being views into its buckets, so
    it is planned as one rank; ZeroRedundancyOptimizer (ZeRO-1) is ZeRO-0 with the optimizer
    state of its fullest rank (`zero1_largest_share`). 1-bit Adam under ZeRO-1/2 (no tp, pp: a
    layout rule) holds a rank's local gradients as one rank does until they are exchanged, and
    the state `capability.held_state_bytes` counts from the optimizer's own chunking. `store`:
    fake builds read from and kept on disk (build_store.py)."""
    return cached(cache, _memory_key(plan), lambda: _memory_of(plan, cache, exhaustive, store))


def _memory_of(
    plan: RunPlan, cache: dict, exhaustive: bool, store: BuildStore | None
) -> MemoryEstimate:
    cfg, world_size = plan.config, plan.dims.world_size
    p, t = cfg.parallel, cfg.training
    capability = optimizer_capability(cfg.optim, zero_stage=p.zero_stage, tp=p.tp, pp=p.pp)
    own_sharding = capability.shards_state  # 1-bit Adam under ZeRO-1/2
    whole = p.tp == p.pp == p.cp == p.ep == 1  # a data-parallel rank holds a whole model
    if (p.zero_stage <= 1 or own_sharding) and whole and world_size > 1:
        single = replanned(
            plan,
            world_size=1,
            parallel=dataclasses.replace(p, zero_stage=0),
            training=dataclasses.replace(t, global_batch_size=t.micro_batch_size),
        )
        base = memory_of(single, cache, exhaustive=exhaustive, store=store)
        optimizer = base.optimizer
        if own_sharding:
            optimizer = held_state_bytes(plan.spec.num_params(plan.model), world_size)
        elif p.zero_stage == 1:
            optimizer = math.ceil(optimizer * zero1_largest_share(cfg.model, world_size))
        return dataclasses.replace(base, optimizer=optimizer)
    if p.zero_stage == 1:
        zero0 = replanned(plan, parallel=dataclasses.replace(p, zero_stage=0))
        base = memory_of(zero0, cache, exhaustive=exhaustive, store=store)
        dp = world_size // (p.tp * p.pp)
        return dataclasses.replace(base, optimizer=-(-base.optimizer // dp))
    return build(store, estimate_memory, MemoryEstimate, plan)


def memory_row(
    plan: RunPlan,
    cache: dict,
    *,
    exhaustive: bool = False,
    store: BuildStore | None = None,
    accumulating: bool | None = None,
) -> dict[str, int]:
    """Bytes per rank of the candidate layout `plan`: params, grads, optimizer, activations,
    peak. A pipeline is planned per micro-batch (it sets the number of microbatches in flight)
    for the rank whose peak is largest. `accumulating`: price the step's later micro-batches
    (True) or its first (False) whatever the config's (None: as it runs)."""
    p, t = plan.config.parallel, plan.config.training
    mb = t.micro_batch_size
    if p.pp == 1:
        mem = memory_of(plan, cache, exhaustive=exhaustive, store=store)
        if accumulating is None:
            accumulating = accumulates(t, p, plan.dims.world_size)
        return {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "activations": mem.activations(mb, accumulating=accumulating),
            "peak": mem.peak(mb, accumulating=accumulating),
        }
    return cached(cache, _pipeline_key(plan), lambda: _pipeline_row(plan, exhaustive, store))


def _pipeline_row(plan: RunPlan, exhaustive: bool, store: BuildStore | None) -> dict[str, int]:
    p, world_size = plan.config.parallel, plan.dims.world_size
    # Ranks of one pp coordinate hold the same stages: plan the first rank of each stage.
    ranks = [world_size // p.pp * s for s in range(p.pp)]
    if not exhaustive:
        shape = plan.spec.shape(plan.model)
        distinct = distinct_stage_ranks(p, plan.config.training, shape)
        ranks = [world_size // p.pp * s for s in distinct]
    built = (build(store, estimate_pipeline_memory, PipelineMemory, plan, rank=r) for r in ranks)
    worst = max(built, key=lambda m: m.peak)
    return {
        "params": worst.params,
        "grads": worst.grads,
        "optimizer": worst.optimizer,
        "activations": worst.activations + worst.comm_buffers,
        "peak": worst.peak,
    }


def distinct_stage_ranks(p: ParallelConfig, t: TrainingConfig, shape: ModelShape) -> list[int]:
    """The pp ranks of the layout `p` of a model of `shape` whose stages differ from every lower
    rank's (the first stage holds the embedding, the last the head, and a stage its share of the
    blocks, which `t` may checkpoint apart): each other rank holds what a lower one does and,
    under every schedule, no more microbatches in flight."""
    num_stages = p.pp * p.pp_stages_per_rank
    layers = stage_layer_ranges(shape.n_layers, num_stages)
    seen, found = set(), []
    for rank in range(p.pp):
        stages = stage_ids_for_rank(rank, p.pp, p.pp_stages_per_rank, p.pp_schedule)
        held = tuple(
            (s == 0, s == num_stages - 1, tuple(_block_kind(t, shape, i) for i in layers[s]))
            for s in stages
        )
        if held not in seen:
            seen.add(held)
            found.append(rank)
    return found


def _block_kind(t: TrainingConfig, shape: ModelShape, index: int) -> tuple[bool, bool]:
    """What block `index` is: an MoE layer or not, checkpointed apart from the others or not
    (selective checkpointing, as parallel/activation_checkpointing.py picks its blocks)."""
    apart = t.activation_checkpointing == "selective" and index % t.ac_every_layers == 0
    return index in shape.moe_layers, apart


def built_row(plan: RunPlan, cache: dict, *, store: BuildStore | None = None) -> dict[str, int]:
    """memory_row of the candidate layout `plan` from fake builds of its family's calibration
    depths (memory_model.calibration_depths) in blocks per pipeline stage, extrapolated linearly
    to the model's depth (a uniform stack: the 7B ZeRO-3 step of 2, 8 and 32 blocks lies on one
    line to the byte), with the step's steepest moment on its own line as the memory model has
    it (a pipeline rank's build keeps only its peak); the full build when the model is no
    deeper."""
    p, t = plan.config.parallel, plan.config.training
    n_layers = plan.spec.shape(plan.model).n_layers
    if not (depths := built_depths(p, t, n_layers)):
        return memory_row(plan, cache, store=store)
    low, high = depths
    scale = (n_layers - low) / (high - low)

    def extrapolated(accumulating: bool | None = None) -> dict[str, int]:
        one, two = (
            memory_row(with_depth(plan, n), cache, store=store, accumulating=accumulating)
            for n in (low, high)
        )
        return {k: round(one[k] + (two[k] - one[k]) * scale) for k in one}

    row = extrapolated()
    if p.pp > 1:
        return row
    # The steepest moment on its own line too (memory_model.Coefficients._scaled says why).
    shallow = tuple(memory_of(with_depth(plan, n), cache, store=store) for n in depths)
    deep = at_depth(shallow, depths, n_layers)
    mb, accumulating = t.micro_batch_size, accumulates(t, p, plan.dims.world_size)

    def activations(row: dict[str, int], accumulating: bool) -> int:
        steep = deep.steep_fwd_bwd(mb, accumulating=accumulating) - deep.params - deep.grads
        return max(row["activations"], steep)

    row["activations"] = activations(row, accumulating)
    if not accumulating:
        # A step's first micro-batch: within the gradients of the held peak (memory_model.
        # Coefficients.above_states says why).
        held = activations(extrapolated(accumulating=True), True)
        row["activations"] = min(max(row["activations"], held - row["grads"]), held)
    fwd_bwd = sum(row[k] for k in ("params", "grads", "optimizer", "activations"))
    row["peak"] = max(row["peak"], fwd_bwd)
    return row


def built_depths(p: ParallelConfig, t: TrainingConfig, n_layers: int) -> tuple[int, ...]:
    """The depths built_row builds the layout `p` (training as `t` says) of a model of
    `n_layers` blocks at: its family's calibration depths in blocks per pipeline stage; () when
    the model is no deeper (then built whole)."""
    per_stage = p.pp * p.pp_stages_per_rank
    low, high = (per_stage * d for d in calibration_depths(family_of(p, t)))
    return () if n_layers <= high else (low, high)


def _memory_key(plan: RunPlan) -> tuple:
    """The key of memory_of's builds in search.plan's cache (the memory model's calibration
    builds are shallower than the model: its depth is in it)."""
    p, t = plan.config.parallel, plan.config.training
    key = (p.tp, p.pp, p.zero_stage, p.dp_replicate, p.dp_shard, t.activation_checkpointing)
    return (*key, p.cp, p.cp_method, p.ep, plan.config.model.n_layers)


def _pipeline_key(plan: RunPlan) -> tuple:
    """The key of a pipeline's memory_row in search.plan's cache."""
    p, t = plan.config.parallel, plan.config.training
    key = ("pp", p.tp, p.pp, p.pp_schedule, p.zero_stage, p.dp_replicate, p.dp_shard, p.ep)
    return (*key, t.micro_batch_size, t.activation_checkpointing, plan.config.model.n_layers)


class _Missing(Exception):
    """A build that a store does not hold (`kept`)."""


@dataclass(frozen=True)
class _ReadOnly:
    """A BuildStore that only reads: a build it does not hold raises _Missing."""

    store: BuildStore

    def build(self, estimate: Callable, result_type: type, plan: RunPlan, *, rank=0):
        if not self.store.has(result_type, plan, rank):
            raise _Missing
        return self.store.build(estimate, result_type, plan, rank=rank)


def kept(function: Callable, plan: RunPlan, store: BuildStore) -> bool:
    """Whether every fake build of `function(plan)` is kept in `store`."""
    try:
        function(plan, {}, store=_ReadOnly(store))
    except Exception:  # noqa: BLE001 - _Missing, or a failed build (not kept; the caller reports it)
        return False
    return True


def build_key(function: Callable, plan: RunPlan) -> tuple:
    """The key under which `function` (memory_of or memory_row) keeps `plan`'s build in a
    cache."""
    pipeline = function is memory_row and plan.config.parallel.pp > 1
    return _pipeline_key(plan) if pipeline else _memory_key(plan)
