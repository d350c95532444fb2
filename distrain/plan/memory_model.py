"""Per-rank memory of a layout by arithmetic, calibrated by a few fake-tensor builds.

The fake build of memory.py costs seconds per block (a 32-block 7B step: ~40 s on a 2-core
machine), so a search of hundreds of layouts prices each one here instead, and only the
fastest few are built (search.py):

- model states (`model_states`): each parameter tensor of the model (parameter_table.py: its
  shape, from a meta build kept in the build store) held by this rank: the blocks of its
  pipeline stages, the embedding on the first stage and the norm and head on the last (the
  family's first- and last-stage submodules; a tied head: its own copy there); split by tp as
  the family's tensor plan splits it, read from the plan itself (torch's styles: column-parallel
  linear weights and their biases along dim 0, row-parallel linear weights along dim 1, a
  row-parallel embedding along dim 0 and a column-parallel one along dim 1; whatever the plan does
  not split replicated); then, under ZeRO-2/3, dim 0 of that local tensor sharded over dp_shard
  (x cp) as FSDP2 does (the first rank holding the rounded-up share); a routed expert's weights
  split over ep and sharded over the data-parallel ranks ep does not use, whatever the ZeRO
  stage. Gradients equal the parameters (sharded under ZeRO-2/3); optimizer state is the
  calibration build's bytes per parameter byte (AdamW: two fp32 moments and a step scalar per
  tensor), divided over the data-parallel ranks under ZeRO-1 (the fullest rank of torch's
  ZeroRedundancyOptimizer without tp or pp) and 1-bit Adam's own chunking under ZeRO-1/2;
- activations: the fwd/bwd peak above the model states at the layout's micro-batch (with the
  gradients held, or for a step of one micro-batch without: memory.MemoryEstimate), a cost per
  block and a constant, measured for a *family* of layouts (tp degree, data-parallel wrapper:
  none/DDP, FSDP2 without or with resharding after forward, activation checkpointing, cp and
  ep degrees) by two fake builds of the planned model at its real width and 2 and 3 blocks (3
  and 4 under FSDP2 resharding with full checkpointing: `calibration_depths`; world: tp x cp,
  x2 under FSDP2, x 2 ep under ep: `calibration_builds`), which
  hold exactly (the 7B ZeRO-3 step of 2, 8 and 32 blocks lies on one line to the byte; with
  full checkpointing, 3, 4 and 5 blocks do, 2 does not; a step's first micro-batch is kept
  within the gradients' bytes of the held peak: `Coefficients.above_states`); every
  layout of the family then costs arithmetic: its stage depth, micro-batch and, for a
  pipeline, the microbatches its schedule keeps in flight (pipeline_memory.in_flight) and its
  receive buffers. A pipeline stage's FSDP2 never reshards after forward, so ZeRO-3 under pp
  is priced with the ZeRO-2 family.

Checked against full fake builds in tests/test_plan_model.py (within 10% on small layouts) and
tests/test_plan_layout_kinds.py (cp, ep and replica groups: within 5%).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from distrain.config.schema import Config, ModelConfig, OptimConfig, ParallelConfig, TrainingConfig
from distrain.family.spec import FamilyModel, ModelShape
from distrain.models.registry import family_name, model_args, model_family
from distrain.optim.capability import held_state_bytes, optimizer_capability
from distrain.parallel.mesh import data_parallel_size
from distrain.parallel.run_plan import RunPlan
from distrain.parallel.stages import stage_ids_for_rank, stage_layer_ranges
from distrain.plan.build_results import MemoryEstimate, accumulates, in_flight
from distrain.plan.parameter_table import table
from distrain.plan.planned import planned_run, replanned

FP32 = 4
CALIBRATION_DEPTHS = (2, 3)
RESHARD_CHECKPOINTED_DEPTHS = (3, 4)
"""The calibration depths of FSDP2 resharding after forward with full checkpointing, whose peak
moves between 2 and 3 blocks (the `tiny` step above its model states: 2.24 MiB at 2 blocks,
1.96 MiB at 3 and every depth after; per sample 0.21, then 0.72 + 0.03 a block): a line
through 2 and 3 blocks over-priced 6 blocks by 17-25%."""
CALIBRATED_TP = 2
"""The largest tp degree calibrated on its own under sequence parallelism (`coefficients_for`)."""


@dataclass(frozen=True)
class Family:
    """What the activation costs depend on besides depth and micro-batch."""

    tp: int
    wrapper: str  # "plain" (no wrapper or DDP, ZeRO-0/1), "fsdp" (ZeRO-2), "fsdp_reshard"
    activation_checkpointing: str
    checkpoint_every: int = 1
    """training.ac_every_layers under selective checkpointing (the period of its blocks)."""
    cp: int = 1
    """Context parallelism: each rank holds 1/cp of every sequence, and its ring buffers."""
    ep: int = 1
    """Expert parallelism: each rank runs the experts' rows sent to it (priced balanced)."""


@dataclass(frozen=True)
class LineCosts:
    """Bytes of one peak line by depth: per sample (per block, constant) and above the model
    states (per block, constant)."""

    sample_per_block: float
    sample_const: float
    fixed_per_block: float
    fixed_const: float


@dataclass(frozen=True)
class Coefficients:
    """One family, measured: its two calibration builds (`builds`, at `depths` blocks) with the
    parameter and gradient bytes of each (`states`), the optimizer state per parameter byte and
    its step's extra peak per parameter byte; `scale` x the per-block and fixed terms (sequence
    parallelism above CALIBRATED_TP)."""

    depths: tuple[int, int]
    builds: tuple[MemoryEstimate, MemoryEstimate]
    states: tuple[int, int]
    optimizer_per_param_byte: float
    step_extra_per_param_byte: float
    scale: float = 1.0

    def _above(self, micro_batch_size: int, accumulating: bool) -> tuple[float, float]:
        """(per block, constant) of the fwd/bwd peak above the model states at this
        micro-batch: each build's peak there (MemoryEstimate.fwd_bwd: the highest of its
        moments), on a line through the two depths."""
        return self._through(
            m.fwd_bwd(micro_batch_size, accumulating=accumulating) - s
            for m, s in zip(self.builds, self.states, strict=True)
        )

    def _depth_line(self, field: str, *, above_states: bool = False) -> tuple[float, float]:
        """(per block, constant) of a field of the builds on the line through the two depths
        (less the model states: `above_states`)."""
        return self._through(
            getattr(m, field) - (s if above_states else 0)
            for m, s in zip(self.builds, self.states, strict=True)
        )

    def _through(self, values: Iterable[float]) -> tuple[float, float]:
        """(per block, constant) of the line through the two builds' `values` at their depths."""
        (low, high), (one, two) = self.depths, values
        per_block = (two - one) / (high - low)
        return per_block, one - low * per_block

    def _steep_lines(self, accumulating: bool) -> list[LineCosts]:
        """The moment growing fastest with the micro-batch (`steep_`: every block's activations
        live, where a deep stack peaks) of a step's first micro-batch and, `accumulating`, with
        the gradients held, each on its own line through the two depths, scaled."""
        found = []
        for moment in ("first_steep_", "steep_")[: 1 + accumulating]:
            fixed_per_block, fixed_const = self._depth_line(f"{moment}fixed", above_states=True)
            sample_per_block, sample_const = self._depth_line(f"{moment}per_sample")
            line = LineCosts(sample_per_block, sample_const, fixed_per_block, fixed_const)
            found.append(self._scaled_line(line))
        return found

    def _scaled_line(self, line: LineCosts) -> LineCosts:
        if self.scale == 1.0:
            return line
        return dataclasses.replace(
            line,
            sample_per_block=line.sample_per_block * self.scale,
            fixed_per_block=line.fixed_per_block * self.scale,
            fixed_const=line.fixed_const * self.scale,
        )

    def lines(self) -> list[LineCosts]:
        """The lines a pipeline stage is priced by (gradients held), the highest at its depth:
        the shallow builds' peaks through the two depths (at micro-batch 1 and 2), and the
        steepest moment on its own line (`_steep_lines`)."""
        (block_one, const_one), (block_two, const_two) = (
            self._above(b, accumulating=True) for b in (1, 2)
        )
        peaks = LineCosts(
            sample_per_block=block_two - block_one,
            sample_const=const_two - const_one,
            fixed_per_block=2 * block_one - block_two,
            fixed_const=2 * const_one - const_two,
        )
        return [self._scaled_line(peaks), *self._steep_lines(True)]

    def above_states(
        self, blocks: int, micro_batch_size: int, *, accumulating: bool, grads: int
    ) -> float:
        """Bytes of the fwd/bwd peak above the model states of a stage of `blocks` blocks. Under
        `scale`, the constant's share that grows with the micro-batch (the embedding, head and
        loss) is kept, read from the next micro-batch's. A step's first micro-batch (not
        `accumulating`) lies between the peak with the gradients held and that peak less the
        stage's gradients (`grads`; at the held peak's moment the first micro-batch lacks at
        most those): its line through two shallow depths can leave that range, as its peak
        moves from the end of forward towards the end of backward while the model deepens
        (`tiny` under ZeRO-2 and full checkpointing at micro-batch 4: 4.07, 3.81, then 3.70 MB
        above the model states from 4 blocks on; the line through 2 and 3 blocks was 18% below
        at 6), and calibrated on 2 ranks it lacks the gradients of that many, not of the row's."""
        value = self._scaled(blocks, micro_batch_size, accumulating)
        if accumulating:
            return value
        held = self._scaled(blocks, micro_batch_size, True)
        return min(max(value, held - grads), held)

    def _scaled(self, blocks: int, micro_batch_size: int, accumulating: bool) -> float:
        """The highest at `blocks` of the line through the shallow builds' peaks at this
        micro-batch and the steepest moments' own lines (`_steep_lines`).

        The highest moment can change with depth: `llama3-8b` with cp 2 under FSDP2 peaks at 2
        and 3 blocks while the gathered embedding and head and their gradients are live (8.4
        GB at any micro-batch), while the blocks' activations (5.0 GB a sample at 2 blocks)
        grow 0.87 GB a sample a block and pass it: through the shallow peaks alone, 32 blocks
        at micro-batch 1 were priced at 7.8 GiB above the states, where that moment alone is
        31 GB. Not every moment on its own line: the moment highest at micro-batch 2 can be
        another one at each depth (`gpt2-tiny`, cp 4: the steep one at 2 blocks, the one
        highest at micro-batch 1 at 3), and its line through the two over-priced 6 blocks by
        13%. `scale` x the per-block and fixed terms."""
        per_block, const = self._above(micro_batch_size, accumulating)
        if self.scale == 1.0:
            through_peaks = const + blocks * per_block
        else:
            _, const_next = self._above(micro_batch_size + 1, accumulating)
            sample_const = const_next - const
            fixed_const = const - micro_batch_size * sample_const
            through_peaks = (fixed_const + blocks * per_block) * self.scale
            through_peaks += micro_batch_size * sample_const
        return max(
            through_peaks,
            *(
                line.fixed_const
                + blocks * (line.fixed_per_block + micro_batch_size * line.sample_per_block)
                + micro_batch_size * line.sample_const
                for line in self._steep_lines(accumulating)
            ),
        )


def family_of(p: ParallelConfig, t: TrainingConfig) -> Family:
    """The family of the layout `p` training as `t` says (its checkpointing)."""
    if p.zero_stage <= 1:
        wrapper = "plain"
    else:
        wrapper = "fsdp_reshard" if p.zero_stage == 3 and p.pp == 1 else "fsdp"
    every = t.ac_every_layers if t.activation_checkpointing == "selective" else 1
    return Family(p.tp, wrapper, t.activation_checkpointing, every, cp=p.cp, ep=p.ep)


def calibrated_family(p: ParallelConfig, t: TrainingConfig) -> Family:
    """The family whose calibration builds price the layout `p`: its own, or under sequence
    parallelism with tp above CALIBRATED_TP the tp = CALIBRATED_TP one (`coefficients_for`)."""
    family = family_of(p, t)
    if family.tp <= CALIBRATED_TP or not p.sequence_parallel:
        return family
    return dataclasses.replace(family, tp=CALIBRATED_TP)


def coefficients_for(
    p: ParallelConfig, t: TrainingConfig, coefficients: Callable[[Family], Coefficients]
) -> Coefficients:
    """The coefficients of the family of the layout `p` training as `t` says. Under sequence
    parallelism with tp above CALIBRATED_TP they are the tp = CALIBRATED_TP family's with the
    per-block and fixed terms scaled by CALIBRATED_TP / tp (the 7B step's per-block
    activations: 45,120 bytes a token at tp 2, 22,560 at tp 4), the constant per sample kept (it
    shrinks by 5% from tp 2 to 4)."""
    family = family_of(p, t)
    c = coefficients(calibrated_family(p, t))
    if family.tp <= CALIBRATED_TP or not p.sequence_parallel:
        return c
    return dataclasses.replace(c, scale=CALIBRATED_TP / family.tp)


def states_floor(
    model: ModelConfig, p: ParallelConfig, optim: OptimConfig, world_size: int
) -> dict[str, int]:
    """A lower bound of the model states of `model` laid out as `p` on `world_size` ranks that
    needs no calibration: parameters and gradients, and AdamW's two fp32 moments per value
    (shared out over the data-parallel ranks under ZeRO-1); its sum is a lower bound of the
    peak."""
    states = model_states(model, p, world_size)
    moments = 2 * states.params if optim.name == "adamw" else 0
    if p.zero_stage == 1:
        moments //= world_size // (p.tp * p.pp)
    return {"params": states.params, "grads": states.grads, "optimizer": moments}


def with_depth(plan: RunPlan, n_layers: int) -> RunPlan:
    """The layout `plan` with a model of `n_layers` blocks (the rest of its shape as planned)."""
    return replanned(plan, model=dataclasses.replace(plan.config.model, n_layers=n_layers))


def calibration_builds(base: Config, family: Family) -> list[RunPlan]:
    """The family's two fake builds, made from the config `base` (the plan's; the layout rules
    checked): its smallest layout (tp x cp ranks, x2 data-parallel shards under FSDP2, no pp;
    under DiLoCo, x2 sites of those, whose outer state is then in the build; under ep, 2 x ep
    data-parallel ranks, so that FSDP2 gathers the experts over 2 as it does over more), one
    sample per data-parallel rank, at each of its `calibration_depths`."""
    plain = family.wrapper == "plain"
    sites = 2 if base.diloco.inner_steps > 0 else 1
    replicate = 2 * family.ep if plain and family.ep > 1 else sites
    shard = 1 if plain else 2 * family.ep
    dp = replicate * shard
    stage = {"plain": 0, "fsdp": 2, "fsdp_reshard": 3}[family.wrapper]
    cfg = dataclasses.replace(
        base,
        parallel=dataclasses.replace(
            base.parallel,
            tp=family.tp,
            cp=family.cp,
            ep=family.ep,
            pp=1,
            zero_stage=stage,
            dp_replicate=replicate,
            dp_shard=shard if stage >= 2 else -1,
        ),
        training=dataclasses.replace(
            base.training,
            micro_batch_size=1,
            global_batch_size=dp,
            activation_checkpointing=family.activation_checkpointing,
        ),
        # Replica groups are priced as HSDP over the groups (search.candidate_plan): the
        # calibration is one group's layout.
        fault_tolerance=dataclasses.replace(base.fault_tolerance, replica_groups=0),
    )
    world = family.tp * family.cp * dp
    return [
        planned_run(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n)), world
        )
        for n in calibration_depths(family)
    ]


def calibration_depths(family: Family) -> tuple[int, int]:
    """The two depths `family` is calibrated at: CALIBRATION_DEPTHS, or RESHARD_CHECKPOINTED_
    DEPTHS under FSDP2 resharding with checkpointing; under selective checkpointing, the
    first multiples of its period from there, one period apart (a line through 2 and 3 blocks,
    one checkpointed of 2 and two of 3, over-priced `tiny`'s 6 blocks by 5-12%).
    built_rows.built_row verifies a layout at the same blocks per stage."""
    checkpointed = family.activation_checkpointing != "none"
    low, high = CALIBRATION_DEPTHS
    if family.wrapper == "fsdp_reshard" and checkpointed:
        low, high = RESHARD_CHECKPOINTED_DEPTHS
    if family.activation_checkpointing == "selective":
        every = family.checkpoint_every
        low = every * -(-low // every)
        return low, low + every
    return low, high


def calibrate_family(
    family: Family, builds: list[RunPlan], measure: Callable[[RunPlan], MemoryEstimate]
) -> Coefficients:
    """The family's coefficients from its `calibration_builds`: `measure(plan)` is memory.py's
    estimate (through the search's caches)."""
    low, high = calibration_depths(family)
    one, two = (measure(b) for b in builds)
    states = [model_states(b.config.model, b.config.parallel, b.dims.world_size) for b in builds]
    step_extra = max(0, one.opt_step_peak - one.model_states)
    return Coefficients(
        depths=(low, high),
        builds=(one, two),
        states=tuple(s.params + s.grads for s in states),
        optimizer_per_param_byte=one.optimizer / max(1, one.params),
        step_extra_per_param_byte=step_extra / max(1, one.params),
    )


@dataclass(frozen=True)
class ModelStates:
    params: int
    grads: int
    blocks: int
    has_head: bool


def _tp_local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> list[int]:
    dims = list(shape)
    if tp > 1 and dim is not None:
        dims[dim] = -(-dims[dim] // tp)
    return dims


def _stage_parts(
    shape: ModelShape, p: ParallelConfig, pp_rank: int
) -> tuple[list[int], bool, bool]:
    """(block indices, holds the embedding, holds the head) of pp rank `pp_rank`."""
    if p.pp == 1:
        return list(range(shape.n_layers)), True, True
    stages = p.pp * p.pp_stages_per_rank
    layers = stage_layer_ranges(shape.n_layers, stages)
    ids = stage_ids_for_rank(pp_rank, p.pp, p.pp_stages_per_rank, p.pp_schedule)
    blocks = [i for s in ids for i in layers[s]]
    return blocks, 0 in ids, stages - 1 in ids


_STATES: dict[tuple, ModelStates] = {}
_MODELS: dict[str, FamilyModel] = {}


def model_of(model: ModelConfig) -> FamilyModel:
    """The family model of `model`, resolved once per model config (the layout rules are the
    caller's to check)."""
    key = repr(model)
    if key not in _MODELS:
        _MODELS[key] = FamilyModel(model_family(family_name(model)), model_args(model))
    return _MODELS[key]


def model_states(
    model: ModelConfig, p: ParallelConfig, world_size: int, *, pp_rank: int = 0
) -> ModelStates:
    """Parameter and gradient bytes of `model` on the first rank of pipeline rank `pp_rank` of
    the layout `p` (module docstring); counted once per model and layout (a plan asks for each
    thousands of times)."""
    key = (
        repr(model),
        p.tp,
        p.pp,
        p.pp_stages_per_rank,
        p.pp_schedule,
        p.zero_stage,
        p.dp_replicate,
        p.ep,
    )
    key += (world_size, pp_rank)
    if key not in _STATES:
        _STATES[key] = _model_states(model_of(model), p, world_size, pp_rank)
    return _STATES[key]


def _model_states(
    model: FamilyModel, p: ParallelConfig, world_size: int, pp_rank: int
) -> ModelStates:
    spec = model.spec
    blocks, first, last = _stage_parts(model.shape, p, pp_rank)
    held = {str(i) for i in blocks}
    # The search's only HSDP: DiLoCo's sites, and replica groups (search.candidate_plan).
    replicas = max(1, p.dp_replicate)
    # FSDP2's shard axis: dp_shard (x cp: world // (tp x pp x replicas) counts both).
    shard = world_size // (p.tp * p.pp * replicas) if p.zero_stage >= 2 else 1
    # A routed expert's weight: split over ep, then FSDP2-sharded over the data-parallel ranks
    # ep does not use, whatever the ZeRO stage (parallel/data_parallel.py's apply_fsdp).
    expert_shard = data_parallel_size(p, world_size) // p.ep
    params = 0
    seen: set[int] = set()
    for parameter in table(model).parameters:
        top, _, rest = parameter.name.partition(".")
        if top == spec.blocks and rest.split(".")[0] not in held:
            continue
        if top in spec.first_stage and not first:
            continue
        if top in spec.last_stage and not last:
            continue
        # A tied head is the embedding's weight: once when a rank holds both.
        if parameter.identity in seen:
            continue
        seen.add(parameter.identity)
        dims = _tp_local_shape(parameter.shape, parameter.tp_dim, p.tp)
        if parameter.expert and p.ep > 1:
            dims[0] = -(-dims[0] // p.ep)
            dims[0] = -(-dims[0] // expert_shard)
        elif shard > 1:
            dims[0] = -(-dims[0] // shard)
        params += FP32 * math.prod(dims)
    return ModelStates(params=params, grads=params, blocks=len(blocks), has_head=last)


def optimizer_bytes(
    model: ModelConfig,
    p: ParallelConfig,
    optim: OptimConfig,
    world_size: int,
    states: ModelStates,
    c: Coefficients,
) -> int:
    """This rank's optimizer state: the family's bytes per parameter byte, shared out under
    ZeRO-1 and by 1-bit Adam's own chunking (as built_rows.memory_of plans the builds)."""
    capability = optimizer_capability(optim, zero_stage=p.zero_stage, tp=p.tp, pp=p.pp)
    if capability.shards_state and p.tp == p.pp == 1 and world_size > 1:
        return held_state_bytes(model_of(model).num_params(), world_size)
    whole = states.params * c.optimizer_per_param_byte
    if p.zero_stage == 1 and world_size > 1:
        if p.tp == p.pp == 1:
            return math.ceil(whole * zero1_largest_share(model, world_size))
        return math.ceil(whole / (world_size // (p.tp * p.pp)))
    return math.ceil(whole)


def zero1_largest_share(model: ModelConfig, world_size: int) -> float:
    """The share of the parameter values of `model` on the rank that ZeroRedundancyOptimizer
    gives the most (its state follows them): torch's rule, group by group, each parameter,
    largest first, to the rank holding the fewest values so far (the first such rank). Whole
    tensors: 4 ranks of the `tiny` preset hold up to 1.075x an even share."""
    held = [0] * world_size
    for group in _group_sizes(model):
        for numel in group:
            held[held.index(min(held))] += numel
    return max(held) / sum(held)


_GROUPS: dict[tuple, list[list[int]]] = {}


def _group_sizes(model: ModelConfig) -> list[list[int]]:
    """Values of each parameter of each of the optimizer's groups (optim/builder.py's
    `param_groups`: decayed, then not), largest first; counted once per model."""
    key = repr(model)
    if key not in _GROUPS:
        unique = table(model_of(model)).unique()
        _GROUPS[key] = [
            sorted((math.prod(p.shape) for p in unique if p.decayed == decayed), reverse=True)
            for decayed in (True, False)
        ]
    return _GROUPS[key]


def with_replica_average(row: dict[str, int]) -> dict[str, int]:
    """A row of a replica-group layout with the groups' exchange after backward
    (ft/replica_groups.py's `average`): the rank's gradient shards flattened into one tensor,
    then copied with the loss and proofs into the one torchft all-reduces, both alive beside the
    gradients and the optimizer state: two more copies of the gradients."""
    held = row["params"] + row["grads"] + row["optimizer"]
    return {**row, "peak": max(row["peak"], held + 2 * row["grads"])}


def modelled_row(
    world_size: int,
    coefficients: Callable[[Family], Coefficients],
    *,
    model: ModelConfig,
    parallel: ParallelConfig,
    training: TrainingConfig,
    optim: OptimConfig,
) -> dict[str, int]:
    """Bytes per rank of `model` laid out as `parallel` on `world_size` ranks, training as
    `training` and `optim` say, the keys of built_rows.memory_row: params, grads, optimizer,
    activations, peak. A pipeline: the largest peak of its ranks (the first keeps the most
    microbatches in flight, the last the head, a middle one more blocks)."""
    p, t = parallel, training
    c = coefficients_for(p, t, coefficients)
    if p.pp == 1:
        states = model_states(model, p, world_size)
        optimizer = optimizer_bytes(model, p, optim, world_size, states, c)
        # ZeRO-1 without tp is planned from the ZeRO-0 build (built_rows.memory_of): its step's
        # peak holds all the state.
        step_optimizer = optimizer
        if p.zero_stage == 1 and p.tp == 1:
            step_optimizer = math.ceil(states.params * c.optimizer_per_param_byte)
        mb, accumulating = t.micro_batch_size, accumulates(t, p, world_size)
        above = c.above_states(states.blocks, mb, accumulating=accumulating, grads=states.grads)
        fwd_bwd = states.params + states.grads + above
        at_rest = states.params + states.grads + optimizer
        step_peak = states.params + states.grads + step_optimizer
        step_peak += states.params * c.step_extra_per_param_byte
        return {
            "params": states.params,
            "grads": states.grads,
            "optimizer": optimizer,
            "activations": max(0, round(above)),
            "peak": round(max(fwd_bwd + optimizer, step_peak, at_rest)),
        }
    rows = [_pipeline_rank(model, p, t, optim, world_size, r, c) for r in range(p.pp)]
    return max(rows, key=lambda r: r["peak"])


def _pipeline_rank(
    model: ModelConfig,
    p: ParallelConfig,
    t: TrainingConfig,
    optim: OptimConfig,
    world_size: int,
    pp_rank: int,
    c: Coefficients,
) -> dict[str, Any]:
    """pp rank `pp_rank`: its stages' blocks with as many microbatches in flight as the
    schedule keeps, the head's cost per sample on the last stage only, and the receive buffers
    of pipeline_memory.py."""
    dim = model_of(model).shape.dim
    states = model_states(model, p, world_size, pp_rank=pp_rank)
    optimizer = optimizer_bytes(model, p, optim, world_size, states, c)
    local_batch = t.global_batch_size // data_parallel_size(p, world_size)
    microbatches = p.pp_microbatches if p.pp_microbatches > 0 else local_batch // t.micro_batch_size
    rows = local_batch // microbatches
    kept = in_flight(p.pp_schedule, p.pp, pp_rank, p.pp_stages_per_rank, microbatches)
    activations = 0
    for line in c.lines():  # the highest of its lines, a microbatch held `kept` times over
        per_sample = states.blocks * line.sample_per_block
        per_sample += line.sample_const if states.has_head else 0
        fixed = max(0, round(line.fixed_const + states.blocks * line.fixed_per_block))
        activations = max(activations, fixed + round(kept * rows * per_sample))
    stages = p.pp * p.pp_stages_per_rank
    ids = [pp_rank + i * p.pp for i in range(p.pp_stages_per_rank)]
    receives = sum((s != 0) + (s != stages - 1) for s in ids)
    boundary = rows * t.seq_len * dim * FP32
    if p.sequence_parallel and p.tp > 1:
        boundary //= p.tp
    comm = receives * microbatches * boundary
    peak = states.params + states.grads + optimizer + activations + comm
    return {
        "params": states.params,
        "grads": states.grads,
        "optimizer": optimizer,
        "activations": activations + comm,
        "peak": peak,
    }
