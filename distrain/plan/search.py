"""The ranked search of `distrain plan`: every layout of the cluster (data-parallel replicate x
shard, tp inside a node, pp with the 1F1B schedule, ZeRO stage, activation checkpointing,
micro-batch), its step time (timing.py) and its memory; layouts that fit come first, fastest
first, then the ones that do not fit with the reason, a layout whose build fails among them.

Memory is priced by memory_model.py (arithmetic, calibrated by fake builds of two shallow
layouts per family) for every layout, or, for an answer that shows the fastest few (plan's
`shown`), for those and the slower ones it needs no further family for (the others are rows
NOT_PRICED); walking the layouts fastest first, the first VERIFIED that
it predicts to fit, and any it puts within MODEL_MARGIN above the device's memory on the way,
are then built on fake tensors (built_rows.py: memory.py; pipeline_memory.py for pp, whose
schedule does not build on fake tensors, from the stage modules and the microbatches the
schedule keeps in flight) at 2 and 3 blocks per stage (3 and 4 under ZeRO-3 with full
checkpointing: memory_model.calibration_depths) and extrapolated in depth (`built_row`), and
that decides.
`exhaustive` builds every layout at full depth and every pipeline rank instead.

The builds are shared: layouts that differ only in the micro-batch share one (memory is linear
in it), and of a pipeline's ranks only the first of those holding alike stages is built (the
others keep no more microbatches in flight); with a BuildStore, every build is kept on disk and
read back by later plans (build_store.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.config.schema import Config, DiLoCoConfig, ParallelConfig, TrainingConfig
from distrain.errors import ConfigError
from distrain.family.spec import FamilyModel, ModelShape
from distrain.layout.facts import divisors
from distrain.layout.rules import validate
from distrain.parallel.run_plan import RunPlan
from distrain.plan.build_results import MemoryEstimate
from distrain.plan.build_sharing import SharedBuilds
from distrain.plan.build_store import BuildStore
from distrain.plan.build_workers import Pool
from distrain.plan.built_rows import built_depths, built_row, cached, memory_of, memory_row
from distrain.plan.comm_advice import DEFAULT_LATENCY_S, CommAdvice, advise
from distrain.plan.memory_model import (
    Coefficients,
    Family,
    calibrate_family,
    calibrated_family,
    calibration_builds,
    model_of,
    modelled_row,
    states_floor,
    with_depth,
    with_replica_average,
)
from distrain.plan.parameter_table import load, stored
from distrain.plan.planned import planned_run
from distrain.plan.timing import Candidate, Cluster, StepTime, step_time

GIB = 2**30
STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "full")
VERIFIED = 1
"""Layouts whose memory a fake build decides: the fastest that the model predicts to fit (the
one an answer recommends; the model's error on every sampled layout is within 5%:
benchmarks/plan_error.py)."""
ADVISED = 3
"""Fitting rows with a data-parallel group, fastest first, given the communication advice."""
MODEL_MARGIN = 0.15
"""A layout the model puts at most this far above the device's memory is built too when met
before VERIFIED layouts fit (the model's error on small layouts: tests/test_plan_model.py)."""
FAILING_FAMILIES = 2
"""Memory model families a plan calibrates, once it holds the fitting rows an answer shows, to
find the rows that do not fit: where nearly every layout fits (a small batch of short sequences
on many devices) the walk would otherwise calibrate every family to find them, each two fake
builds of the model's width (a 7B question at the default batch: every one of 30 families)."""
NOT_PRICED = "not priced"
"""The memory source of a row plan() left unpriced: slower than every row shown, of a family
not calibrated (plan's `shown`)."""
UNPRICED_REASON = "not priced: slower than the rows shown, its memory model family not calibrated"
PRELOAD = ("distrain.plan.search", "distrain.plan.pipeline_memory", "torch._dynamo")
"""What the build workers' forkserver imports once: the planner, the fake builds (memory.py with
pipeline_memory.py, which built_rows.py imports only when it makes one), and what a first fake
build would import (dynamo, through torch's Python reference of `normal_`: 0.5 s)."""
SOURCE_LABEL = {"fake build": "built", "model": "model", NOT_PRICED: "-"}


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    memory: dict[str, int]
    time: StepTime
    fits: bool
    reason: str
    memory_source: str = "fake build"
    """"fake build" (memory.py, pipeline_memory.py), "model" (memory_model.py) or NOT_PRICED."""
    communication: CommAdvice | None = None
    """The data-parallel communication advice (comm_advice.py), for the best rows."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.candidate),
            "memory_bytes": self.memory,
            "memory_source": self.memory_source,
            "time": self.time.as_dict(),
            "fits": self.fits,
            "reason": self.reason,
            "communication": None if self.communication is None else self.communication.as_dict(),
        }


def candidate_parallel(p: ParallelConfig, c: Candidate) -> ParallelConfig:
    """The parallel section of layout `c`: `p` with its degrees, schedule and ZeRO stage."""
    return dataclasses.replace(
        p,
        dp_replicate=c.dp_replicate if c.zero_stage >= 2 else -1,
        dp_shard=c.dp_shard if c.zero_stage >= 2 else -1,
        tp=c.tp,
        pp=c.pp,
        pp_schedule=c.pp_schedule,
        zero_stage=c.zero_stage,
        cp=c.cp,
        ep=c.ep,
    )


def candidate_plan(base: Config, c: Candidate, world_size: int) -> RunPlan:
    """The run of layout `c` on `world_size` ranks, made from the config `base` (the plan's; the
    layout rules checked)."""
    cfg = dataclasses.replace(
        base,
        parallel=candidate_parallel(base.parallel, c),
        training=dataclasses.replace(
            base.training,
            micro_batch_size=c.micro_batch_size,
            activation_checkpointing=c.activation_checkpointing,
        ),
    )
    if c.groups:
        # Priced as HSDP over the groups: a rank holds the same shards and runs the same step;
        # the groups' own exchange is added by memory_model.with_replica_average and the
        # step-time model.
        cfg.fault_tolerance = dataclasses.replace(cfg.fault_tolerance, replica_groups=0)
    return planned_run(cfg, world_size)


def candidates(
    shape: ModelShape,
    cluster: Cluster,
    *,
    global_batch: int,
    replica_groups: int = 0,
    stages: tuple[int, ...] = STAGES,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
) -> list[Candidate]:
    """Every layout of the cluster: tp (powers of 2) inside a node, cp (powers of 2, for a
    family with attention to split and without experts) beside it inside the node, pp (powers
    of 2 up to the blocks) and the data-parallel rest, with ep (the expert counts dividing it)
    for an MoE model. cp is searched without pp (the planner's pipeline build has no sequence
    split) and under FSDP2 (ZeRO-2/3: the shard axis is dp_shard x cp, as torchtitan lays it
    out), ep without ZeRO-1. `global_batch`: training.global_batch_size; `replica_groups`:
    fault_tolerance.replica_groups."""
    world, groups = cluster.world_size, replica_groups
    found = []
    tp = 1
    while tp <= cluster.gpus_per_node and world % tp == 0:
        if groups:
            found += _replica_group_layouts(
                groups, global_batch, world, tp, shape.n_layers, stages, checkpointing
            )
            tp *= 2
            continue
        for cp in _context_degrees(shape, cluster.gpus_per_node // tp, world // tp):
            pp = 1
            while pp <= shape.n_layers and world % (tp * cp * pp) == 0 and (pp == 1 or cp == 1):
                dp = world // (tp * cp * pp)
                for ep in _expert_degrees(shape, dp):
                    # Without data parallelism (or cp) every ZeRO stage is stage 0.
                    kept = (0,) if dp * cp == 1 else _stages_searched(stages, cp, ep)
                    found += [
                        dataclasses.replace(c, cp=cp, ep=ep)
                        for c in _data_parallel(dp, tp, pp, global_batch, kept, checkpointing)
                    ]
                pp *= 2
        tp *= 2
    return found


def _replica_group_layouts(
    groups: int,
    global_batch: int,
    world: int,
    tp: int,
    n_layers: int,
    stages: tuple[int, ...],
    checkpointing: tuple[str, ...],
) -> list[Candidate]:
    """Under fault_tolerance.replica_groups = R (`groups`): the layouts of R groups of world / R
    ranks, each FSDP2 (ZeRO-2/3) over its data-parallel ranks (one rank too) with tp and pp, and
    no cp, ep or further replication (what the layout rules allow a group)."""
    found = []
    pp = 1
    while world % (groups * tp * pp) == 0 and pp <= n_layers:
        shard = world // (groups * tp * pp)
        dp = groups * shard
        for stage in (s for s in stages if s >= 2):
            for ac in checkpointing:
                for mb in divisors(global_batch // dp):
                    found.append(Candidate(groups, shard, tp, pp, stage, ac, mb, groups=groups))
        pp *= 2
    return found


def _context_degrees(shape: ModelShape, room: int, ranks: int) -> list[int]:
    """cp degrees searched: 1, and for a family with attention and no experts the powers of 2
    that fit `room` devices of a node and divide `ranks`."""
    degrees, cp = [1], 2
    while shape.kv_width and not shape.num_experts and cp <= room and ranks % cp == 0:
        degrees.append(cp)
        cp *= 2
    return degrees


def _expert_degrees(shape: ModelShape, dp: int) -> list[int]:
    """ep degrees searched: the divisors of the expert count that divide the data-parallel
    size (1 alone for a dense model)."""
    return [e for e in divisors(shape.num_experts) if dp % e == 0] if shape.num_experts else [1]


def _stages_searched(stages: tuple[int, ...], cp: int, ep: int) -> tuple[int, ...]:
    """The ZeRO stages searched with cp (FSDP2's: 2 and 3) and ep (not ZeRO-1)."""
    return tuple(s for s in stages if (cp == 1 or s >= 2) and (ep == 1 or s != 1))


def _data_parallel(
    dp: int,
    tp: int,
    pp: int,
    global_batch: int,
    stages: tuple[int, ...],
    checkpointing: tuple[str, ...],
) -> list[Candidate]:
    found = []
    for stage in stages:
        splits = [(dp, 1)] if stage <= 1 else [(r, dp // r) for r in divisors(dp)]
        for replicate, shard in splits:
            if stage >= 2 and shard == 1 and dp > 1:
                continue
            for ac in checkpointing:
                for mb in divisors(global_batch // dp if dp else 1):
                    found.append(Candidate(replicate, shard, tp, pp, stage, ac, mb))
    return found


def plan(
    base: Config,
    cluster: Cluster,
    *,
    bytes_per_value: int = 4,
    max_micro_batch: int = 16,
    stages: tuple[int, ...] = STAGES,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
    exhaustive: bool = False,
    verify: int = VERIFIED,
    workers: int = 1,
    shown: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    store: BuildStore | None = None,
    pool: Pool | None = None,
) -> list[PlanRow]:
    """Every valid candidate with its memory and time, ranked (fitting and fastest first). A
    candidate whose memory cannot be evaluated is a row that does not fit, with the error as
    its reason. `progress(done, total)` is called after each candidate.

    Memory comes from memory_model.py, and for the `verify` fastest layouts it predicts to fit
    (and those it cannot tell, within MODEL_MARGIN of the device's memory, met on the way) from
    fake builds (`built_row`), which then decide; `exhaustive`: every layout's full fake build.

    `shown`: the rows an answer shows, the `shown` fastest that fit and the `shown` fastest that
    do not (None: every row, priced). The layouts are walked fastest first, and a memory model
    family is calibrated when a layout met needs it; once the walk holds the rows shown (and the
    fastest fitting row with a data-parallel group, whose communication the answer advises, and
    the `verify` rows built), a later layout is still priced when its model states alone exceed
    the device or its family was needed before that point, and is otherwise a row NOT_PRICED,
    ranked after every priced row. While the rows shown are held and that fitting row with a
    data-parallel group is not, only a layout that has one (`advisable`) may need a family not
    needed before; another is a row NOT_PRICED. The rows that do not fit are looked for in at most
    FAILING_FAMILIES families more than the fitting rows needed (so the calibrations are
    bounded where nearly every layout fits); then fewer than `shown` of them may be priced. The
    rows (every one) are the same for any `workers` and `store`, and the shown ones those of
    `shown=None` while that bound is not met.

    `workers` > 1: the fake builds are shared with `workers - 1` worker processes
    (build_workers.Pool, started first when a build is to be made: they import torch and the
    planner while this process lists the layouts), each made by whichever process claims it
    first, the calibrations of the next families the walk meets sent to them ahead
    (build_sharing.py); they keep them in `store` (a temporary one without it) for this
    process to read back. `store`: every fake build read from disk when kept there, and
    kept there when made (build_store.py). `pool`: build workers to use instead (the caller's
    to close; `workers` then counts them and this process)."""
    own = pool is None
    if pool is None:
        pool = Pool(max(1, workers - 1), preload=PRELOAD)
    else:
        workers = pool.workers + 1
    if workers > 1 and (store is None or not stored(model_of(base.model), store)):
        pool.start_soon()  # a model not planned here before: every build is to be made
    try:
        layouts = timed_layouts(
            base,
            cluster,
            bytes_per_value=bytes_per_value,
            max_micro_batch=max_micro_batch,
            stages=stages,
            checkpointing=checkpointing,
        )
        load(model_of(base.model), store)  # the parameter table: read from the store, not built
    except BaseException:
        if own:
            pool.close()
        raise
    cache: dict = {}
    coefficients: dict = {}
    capacity = cluster.memory_bytes
    world = cluster.world_size
    families = [] if exhaustive else [_family_needed(run, capacity) for _, run, _ in layouts]

    def calibration_calls(family: Family) -> list[tuple[Callable, RunPlan]]:
        """memory_of of the family's calibration builds; none when they cannot be planned (its
        own calibration reports why)."""
        try:
            return [(memory_of, b) for b in calibration_builds(base, family)]
        except Exception:  # noqa: BLE001 - the family's rows report it (coefficients_of)
            return []

    first = next((f for f in families if f is not None), None)
    if (
        workers > 1
        and first is not None
        and not (store and _stored(store, calibration_calls(first)))
    ):
        pool.start_soon()  # a cold plan: its workers import torch and the planner meanwhile
    if workers > 1 and store is None:
        scratch = tempfile.TemporaryDirectory(prefix="distrain-plan-")
        store = BuildStore(Path(scratch.name))  # where the workers' builds reach this process

    # Builds made by this process or a worker (build_sharing.py), then each call made as before,
    # reading them back; at the end, this plan's own workers are stopped, a build sent ahead
    # unfinished.
    shared = SharedBuilds(pool, store, discard=own) if workers > 1 and store else None
    met = list(dict.fromkeys(f for f in families if f is not None))  # in the walk's order

    def coefficients_of(family: Family) -> Coefficients:
        def measure(run: RunPlan) -> MemoryEstimate:
            return memory_of(run, cache, store=store)

        def calibrated() -> Coefficients:
            builds = calibration_builds(base, family)
            for run in builds:  # the shallow models' tables too
                load(model_of(run.config.model), store)
            if shared is not None:
                at = met.index(family) + 1 if family in met else len(met)
                after = [c for f in met[at : at + workers - 1] for c in calibration_calls(f)]
                shared.now(calibration_calls(family), cache, then=after)
            return calibrate_family(family, builds, measure)

        return cached(coefficients, family, calibrated)

    def built(run: RunPlan) -> dict[str, int]:
        if exhaustive:
            return memory_row(run, cache, exhaustive=True, store=store)
        if shared is not None:
            n_layers = run.spec.shape(run.model).n_layers
            depths = built_depths(run.config.parallel, run.config.training, n_layers)
            shared.now([(memory_row, with_depth(run, n)) for n in depths], cache)
        return built_row(run, cache, store=store)

    rows = []
    verified = fitting = failing = 0
    grouped = False  # a fitting row with a data-parallel group met
    needed: set[Family] = set()  # the families the layouts met before the shown rows were held
    failing_from: int | None = None  # how many were needed once the fitting rows were held
    with pool if own else contextlib.nullcontext(pool), shared or contextlib.nullcontext():
        for done, (c, run, time) in enumerate(layouts, 1):
            shown_held = (
                shown is not None and not exhaustive and fitting >= shown and verified >= verify
            )
            fitting_held = shown_held and grouped
            if fitting_held and failing_from is None:
                failing_from = len(needed)
            held = fitting_held and (
                failing >= shown or len(needed) >= failing_from + FAILING_FAMILIES
            )
            # Rows shown held, a fitting one with a data-parallel group still to find: only a
            # layout that has one may need a new family (an MoE model's fastest layouts are ep
            # ones, none advisable: every ep family was calibrated before the first without ep).
            seeking = shown_held and not grouped and not advisable(c)
            family = None if exhaustive else families[done - 1]
            if (held or seeking) and family is not None and family not in needed:
                rows.append(PlanRow(c, {}, time, False, UNPRICED_REASON, NOT_PRICED))
                if progress is not None:
                    progress(done, len(layouts))
                continue
            source, cfg = "fake build", run.config
            try:
                if exhaustive:
                    memory = built(run)
                elif (
                    sum((floor := states_floor(cfg.model, cfg.parallel, cfg.optim, world)).values())
                    > capacity
                ):
                    memory, source = floor, "model"
                else:
                    needed.add(family)  # not None: the floor fits
                    memory = modelled_row(
                        world,
                        coefficients_of,
                        model=cfg.model,
                        parallel=cfg.parallel,
                        training=cfg.training,
                        optim=cfg.optim,
                    )
                    source = "model"
                    peak = memory["peak"]
                    if verified < verify and peak <= capacity * (1 + MODEL_MARGIN):
                        memory, source = built(run), "fake build"
            except Exception as error:  # noqa: BLE001 - a layout that cannot be built is a row
                reason = f"not evaluated: {one_line(error)}"
                rows.append(PlanRow(c, {}, time, False, reason, source))
                failing += 1
            else:
                if c.groups and "peak" in memory:
                    memory = with_replica_average(memory)
                if "peak" in memory:
                    what, peak = "peak", memory["peak"]
                else:
                    what, peak = "model states alone", sum(memory.values())
                fits = peak <= capacity
                verified += fits and source == "fake build"
                fitting += fits
                failing += not fits
                grouped = grouped or (fits and advisable(c))
                reason = (
                    ""
                    if fits
                    else f"{what} {peak / GIB:.1f} GiB > {capacity / GIB:.1f} GiB per device"
                )
                rows.append(PlanRow(c, memory, time, fits, reason, source))
            if progress is not None:
                progress(done, len(layouts))
    rows.sort(key=lambda r: (not r.fits, r.memory_source == NOT_PRICED, r.time.step_s))
    return rows


def timed_layouts(
    base: Config,
    cluster: Cluster,
    *,
    bytes_per_value: int,
    max_micro_batch: int,
    stages: tuple[int, ...],
    checkpointing: tuple[str, ...],
) -> list[tuple[Candidate, RunPlan, StepTime]]:
    """The valid candidates plan() searches, each with its run (`candidate_plan`) and step
    time, fastest first."""
    model = validate(base, None).family_model
    layouts = []
    # HSDP is searched through its pure forms, but DiLoCo's sites are its replicas.
    hsdp = base.diloco.inner_steps > 0
    found = candidates(
        model.shape,
        cluster,
        global_batch=base.training.global_batch_size,
        replica_groups=base.fault_tolerance.replica_groups,
        stages=stages,
        checkpointing=checkpointing,
    )
    for c in found:
        if c.micro_batch_size > max_micro_batch:
            continue
        if c.dp_replicate > 1 and c.dp_shard > 1 and not hsdp and not c.groups:
            continue
        try:
            run = candidate_plan(base, c, cluster.world_size)
        except ConfigError:
            continue
        time = step_time(
            c,
            model,
            cluster,
            global_batch=base.training.global_batch_size,
            seq_len=base.training.seq_len,
            bytes_per_value=bytes_per_value,
        )
        layouts.append((c, run, time))
    layouts.sort(key=lambda layout: layout[2].step_s)
    return layouts


def _family_needed(run: RunPlan, capacity: float) -> Family | None:
    """The family the memory model prices the layout `run` with; None when its model states
    alone exceed `capacity` (no family needed) or cannot be counted (its row reports why)."""
    cfg = run.config
    try:
        floor = states_floor(cfg.model, cfg.parallel, cfg.optim, run.dims.world_size)
        if sum(floor.values()) <= capacity:
            return calibrated_family(cfg.parallel, cfg.training)
    except Exception:  # noqa: BLE001 - the layout's own row reports it (plan)
        return None
    return None


def _stored(store: BuildStore, calls: list[tuple[Callable, RunPlan]]) -> bool:
    """Whether `store` keeps the builds of `calls` (a family's calibration; none: not)."""
    return bool(calls) and all(store.has(MemoryEstimate, run) for _, run in calls)


def with_advice(
    rows: list[PlanRow],
    model: FamilyModel,
    cluster: Cluster,
    *,
    training: TrainingConfig,
    diloco: DiLoCoConfig,
    bytes_per_value: int,
    latency_s: float = DEFAULT_LATENCY_S,
    count: int = ADVISED,
) -> list[PlanRow]:
    """`rows` of `model` with the communication advice of the first `count` that fit and have a
    data-parallel group (comm_advice.py; DiLoCo's H at most training.steps, its sync in
    diloco.sync_dtype). A layout without one (dp 1: tp x pp over every device) has no gradient
    exchange to choose a method for (`advisable`)."""
    advised, out = 0, []
    for row in rows:
        if row.fits and advisable(row.candidate) and advised < count:
            advice = advise(
                row.candidate,
                model,
                cluster,
                global_batch=training.global_batch_size,
                seq_len=training.seq_len,
                bytes_per_value=bytes_per_value,
                latency_s=latency_s,
                max_inner_steps=training.steps,
                sync_dtype=diloco.sync_dtype,
            )
            row = dataclasses.replace(row, communication=advice)
            advised += 1
        out.append(row)
    return out


def advisable(c: Candidate) -> bool:
    """Whether layout `c` has a data-parallel gradient exchange to choose a method for: a
    data-parallel group, and neither expert parallelism (it runs on FSDP2, which has no place
    for the methods' DDP communication hooks: layout/facts.py's ep_conflict) nor replica groups
    (their exchange is torchft's)."""
    return c.dp > 1 and c.ep == 1 and not c.groups


def one_line(error: Exception) -> str:
    """`Type: first line of the message`, at most 200 characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def table(rows: list[PlanRow], top: int) -> str:
    """Every column of the `top` fastest layouts that fit and the `top` that do not, with the
    communication advice of the advised rows (`distrain plan --wide`)."""
    header = (
        f"{'#':>3} {'dp_rep':>6} {'dp_shd':>6} {'tp':>3} {'cp':>3} {'pp':>3} {'ep':>3} "
        f"{'zero':>4} {'ac':>4} "
        f"{'mb':>3} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'peak':>7} "
        f"{'step s':>8} {'comm s':>7} {'bubble':>6} {'tok/s':>9} {'MFU':>5} {'memory':>6}  fits"
    )
    lines = [
        header + "   (memory GiB per rank: from a fake build, or the memory model)",
        "-" * len(header),
    ]
    shown = [r for r in rows if r.fits][:top] + [r for r in rows if not r.fits][:top]
    for i, r in enumerate(shown, 1):
        c, m, t = r.candidate, r.memory, r.time
        kinds = ("params", "grads", "optimizer", "activations", "peak")
        gib = [f"{m[k] / GIB:7.2f}" if k in m else f"{'-':>7}" for k in kinds]
        lines.append(
            f"{i:>3} {c.dp_replicate:>6} {c.dp_shard:>6} {c.tp:>3} {c.cp:>3} {c.pp:>3} {c.ep:>3} "
            f"{c.zero_stage:>4} "
            f"{c.activation_checkpointing:>4} {c.micro_batch_size:>3} {' '.join(gib)} "
            f"{t.step_s:8.3f} {t.exposed_comm_s:7.3f} {t.bubble_s:6.3f} {t.tokens_per_s:9.0f} "
            f"{t.mfu:5.2f} {SOURCE_LABEL[r.memory_source]:>6}  "
            f"{'yes' if r.fits else 'no: ' + r.reason}"
        )
    advised = [(i, r) for i, r in enumerate(shown, 1) if r.communication is not None]
    if advised:
        lines.append("data-parallel communication (predicted per step):")
    for i, r in advised:
        lines.append(f"{i:>3} {r.communication.summary()}")
    return "\n".join(lines)


def to_json(rows: list[PlanRow], top: int) -> str:
    return json.dumps([r.as_dict() for r in rows[:top]], indent=1)
