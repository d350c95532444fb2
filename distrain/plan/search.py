"""The ranked search of `distrain plan`: every layout of the cluster (data-parallel replicate x
shard, tp inside a node, pp with the 1F1B schedule, ZeRO stage, activation checkpointing,
micro-batch), its memory from the fake build (memory.py; pipeline_memory.py for pp, whose
schedule does not build on fake tensors, from the stage modules and the microbatches the schedule
keeps in flight) and its step time (timing.py); layouts that fit come first, fastest first, then
the ones that do not fit with the reason, a layout whose build fails among them.

The builds are shared: layouts that differ only in the micro-batch share one (memory is linear
in it), and of a pipeline's ranks only the first of those holding alike stages is built (the
others keep no more microbatches in flight); `exhaustive` builds every pipeline rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distrain.config.schema import Config
from distrain.errors import ConfigError
from distrain.layout.facts import divisors
from distrain.layout.rules import validate
from distrain.models.gpt.model import GPT
from distrain.models.presets import model_args, num_params
from distrain.optim.builder import param_groups
from distrain.optim.capability import optimizer_capability
from distrain.optim.onebit_zero import held_state_bytes
from distrain.plan.memory import MemoryEstimate, estimate_memory
from distrain.plan.pipeline_memory import estimate_pipeline_memory
from distrain.plan.timing import Candidate, Cluster, StepTime, step_time

GIB = 2**30
STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "full")


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    memory: dict[str, int]
    time: StepTime
    fits: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.candidate),
            "memory_bytes": self.memory,
            "time": self.time.as_dict(),
            "fits": self.fits,
            "reason": self.reason,
        }


def candidate_config(base: Config, c: Candidate) -> Config:
    cfg = dataclasses.replace(
        base,
        parallel=dataclasses.replace(
            base.parallel,
            dp_replicate=c.dp_replicate,
            dp_shard=c.dp_shard if c.zero_stage >= 2 else -1,
            tp=c.tp,
            pp=c.pp,
            pp_schedule=c.pp_schedule,
            zero_stage=c.zero_stage,
        ),
        training=dataclasses.replace(
            base.training,
            micro_batch_size=c.micro_batch_size,
            activation_checkpointing=c.activation_checkpointing,
        ),
    )
    if c.zero_stage <= 1:
        cfg.parallel.dp_replicate = -1
    return cfg


def _cached(cache: dict, key: tuple, compute: Callable[[], Any]) -> Any:
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
    cfg: Config, world_size: int, cache: dict, *, exhaustive: bool = False
) -> MemoryEstimate:
    """estimate_memory, shared between candidates that differ only in the micro-batch.

    Two wrappers read tensor data while they are built, so they cannot run on fake tensors, and
    are planned from the build they wrap: DDP (its C++ reducer checks parameter values across
    ranks) holds what the unwrapped model holds, its gradients being views into its buckets, so
    it is planned as one rank; ZeroRedundancyOptimizer (ZeRO-1) is ZeRO-0 with the optimizer
    state of its fullest rank (`zero1_largest_share`). 1-bit Adam under ZeRO-1/2 (no tp, pp: a
    layout rule) holds a rank's local gradients as one rank does until they are exchanged, and
    the state `onebit_zero.held_state_bytes` counts from the optimizer's own chunking."""
    p, t = cfg.parallel, cfg.training
    key = (p.tp, p.pp, p.zero_stage, p.dp_replicate, p.dp_shard, t.activation_checkpointing)
    return _cached(cache, key, lambda: _memory_of(cfg, world_size, cache, exhaustive))


def _memory_of(cfg: Config, world_size: int, cache: dict, exhaustive: bool) -> MemoryEstimate:
    p, t = cfg.parallel, cfg.training
    capability = optimizer_capability(cfg.optim, zero_stage=p.zero_stage, tp=p.tp, pp=p.pp)
    own_sharding = capability.shards_state  # 1-bit Adam under ZeRO-1/2
    if (p.zero_stage <= 1 or own_sharding) and p.tp == p.pp == 1 and world_size > 1:
        single = dataclasses.replace(
            cfg,
            parallel=dataclasses.replace(p, zero_stage=0),
            training=dataclasses.replace(t, global_batch_size=t.micro_batch_size),
        )
        base = memory_of(single, 1, cache, exhaustive=exhaustive)
        optimizer = base.optimizer
        if own_sharding:
            optimizer = held_state_bytes(num_params(model_args(cfg.model)), world_size)
        elif p.zero_stage == 1:
            optimizer = math.ceil(optimizer * zero1_largest_share(cfg, world_size))
        return dataclasses.replace(base, optimizer=optimizer)
    if p.zero_stage == 1:
        zero0 = dataclasses.replace(cfg, parallel=dataclasses.replace(p, zero_stage=0))
        base = memory_of(zero0, world_size, cache, exhaustive=exhaustive)
        dp = world_size // (p.tp * p.pp)
        return dataclasses.replace(base, optimizer=-(-base.optimizer // dp))
    return estimate_memory(cfg, world_size)


def zero1_largest_share(cfg: Config, world_size: int) -> float:
    """The share of the parameter values on the rank that ZeroRedundancyOptimizer gives the most
    (its state follows them): torch's rule, group by group, each parameter, largest first, to
    the rank holding the fewest values so far (the first such rank). Whole tensors: 4 ranks of
    the `tiny` preset hold up to 1.075x an even share."""
    with torch.device("meta"):
        model = GPT(model_args(cfg.model))
    held = [0] * world_size
    for group in param_groups(model, cfg.optim.weight_decay):
        for param in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            held[held.index(min(held))] += param.numel()
    return max(held) / sum(held)


def memory_row(
    cfg: Config, world_size: int, cache: dict, *, exhaustive: bool = False
) -> dict[str, int]:
    """Bytes per rank of one candidate: params, grads, optimizer, activations, peak. A pipeline
    is planned per micro-batch (it sets the number of microbatches in flight) for the rank
    whose peak is largest."""
    p, mb = cfg.parallel, cfg.training.micro_batch_size
    if p.pp == 1:
        mem = memory_of(cfg, world_size, cache, exhaustive=exhaustive)
        return {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "activations": mem.activations(mb),
            "peak": mem.peak(mb),
        }
    key = ("pp", p.tp, p.pp, p.pp_schedule, p.zero_stage, p.dp_replicate, p.dp_shard, mb)
    key += (cfg.training.activation_checkpointing,)
    return _cached(cache, key, lambda: _pipeline_row(cfg, world_size, exhaustive))


def _pipeline_row(cfg: Config, world_size: int, exhaustive: bool) -> dict[str, int]:
    p = cfg.parallel
    # Ranks of one pp coordinate hold the same stages: plan the first rank of each stage.
    ranks = [world_size // p.pp * s for s in range(p.pp)]
    if not exhaustive:
        ranks = [world_size // p.pp * s for s in distinct_stage_ranks(cfg)]
    worst = max(
        (estimate_pipeline_memory(cfg, world_size, rank=r) for r in ranks), key=lambda m: m.peak
    )
    return {
        "params": worst.params,
        "grads": worst.grads,
        "optimizer": worst.optimizer,
        "activations": worst.activations + worst.comm_buffers,
        "peak": worst.peak,
    }


def distinct_stage_ranks(cfg: Config) -> list[int]:
    """The pp ranks whose stages differ from every lower rank's (the first stage holds the
    embedding, the last the head, and a stage its share of the blocks): each other rank holds
    what a lower one does and, under every schedule, no more microbatches in flight."""
    from distrain.parallel.pipeline import stage_ids_for_rank, stage_layer_ranges

    p, args = cfg.parallel, validate(cfg, None).model
    num_stages = p.pp * p.pp_stages_per_rank
    layers = stage_layer_ranges(args.n_layers, num_stages)
    seen, found = set(), []
    for rank in range(p.pp):
        stages = stage_ids_for_rank(rank, p.pp, p.pp_stages_per_rank, p.pp_schedule)
        held = tuple(
            (s == 0, s == num_stages - 1, tuple(_block_kind(cfg, args, i) for i in layers[s]))
            for s in stages
        )
        if held not in seen:
            seen.add(held)
            found.append(rank)
    return found


def _block_kind(cfg: Config, args: Any, index: int) -> tuple[bool, bool]:
    """What block `index` is: an MoE layer or not, checkpointed apart from the others or not
    (selective checkpointing, as parallel/activation_checkpointing.py picks its blocks)."""
    t = cfg.training
    apart = t.activation_checkpointing == "selective" and index % t.ac_every_layers == 0
    return args.moe.is_moe_layer(index), apart


def candidates(
    base: Config,
    cluster: Cluster,
    *,
    stages: tuple[int, ...] = STAGES,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
) -> list[Candidate]:
    world, t = cluster.world_size, base.training
    n_layers = validate(base, None).model.n_layers
    found = []
    tp = 1
    while tp <= cluster.gpus_per_node and world % tp == 0:
        pp = 1
        while pp <= n_layers and world % (tp * pp) == 0:
            found += _data_parallel(world // (tp * pp), tp, pp, t, stages, checkpointing)
            pp *= 2
        tp *= 2
    return found


def _data_parallel(
    dp: int,
    tp: int,
    pp: int,
    t: Any,
    stages: tuple[int, ...],
    checkpointing: tuple[str, ...],
) -> list[Candidate]:
    found = []
    # Without data parallelism every ZeRO stage is stage 0.
    for stage in stages if dp > 1 else (0,):
        splits = [(dp, 1)] if stage <= 1 else [(r, dp // r) for r in divisors(dp)]
        for replicate, shard in splits:
            if stage >= 2 and shard == 1 and dp > 1:
                continue
            for ac in checkpointing:
                for mb in divisors(t.global_batch_size // dp if dp else 1):
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
    progress: Callable[[int, int], None] | None = None,
) -> list[PlanRow]:
    """Every valid candidate with its memory and time, ranked (fitting and fastest first). A
    candidate whose memory cannot be evaluated is a row that does not fit, with the error as
    its reason. `progress(done, total)` is called after each candidate."""
    args = validate(base, None).model
    layouts = []
    for c in candidates(base, cluster, stages=stages, checkpointing=checkpointing):
        if c.micro_batch_size > max_micro_batch or (c.dp_replicate > 1 and c.dp_shard > 1):
            continue  # HSDP is searched through its pure forms; micro-batches past the cap
        cfg = candidate_config(base, c)
        try:
            validate(cfg, cluster.world_size)
        except ConfigError:
            continue
        layouts.append((c, cfg))
    cache: dict = {}
    rows = []
    for done, (c, cfg) in enumerate(layouts, 1):
        time = step_time(
            c,
            args,
            cluster,
            global_batch=base.training.global_batch_size,
            seq_len=base.training.seq_len,
            bytes_per_value=bytes_per_value,
        )
        try:
            memory = memory_row(cfg, cluster.world_size, cache, exhaustive=exhaustive)
        except Exception as error:  # noqa: BLE001 - a layout that cannot be built is a row
            rows.append(PlanRow(c, {}, time, False, f"not evaluated: {one_line(error)}"))
        else:
            peak = memory["peak"]
            fits = peak <= cluster.memory_bytes
            reason = (
                ""
                if fits
                else f"peak {peak / GIB:.1f} GiB > {cluster.memory_bytes / GIB:.1f} GiB per device"
            )
            rows.append(PlanRow(c, memory, time, fits, reason))
        if progress is not None:
            progress(done, len(layouts))
    rows.sort(key=lambda r: (not r.fits, r.time.step_s))
    return rows


def one_line(error: Exception) -> str:
    """`Type: first line of the message`, at most 200 characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def table(rows: list[PlanRow], top: int) -> str:
    header = (
        f"{'#':>3} {'dp_rep':>6} {'dp_shd':>6} {'tp':>3} {'pp':>3} {'zero':>4} {'ac':>4} "
        f"{'mb':>3} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'peak':>7} "
        f"{'step s':>8} {'comm s':>7} {'bubble':>6} {'tok/s':>9} {'MFU':>5}  fits"
    )
    lines = [header + "   (memory GiB per rank)", "-" * len(header)]
    shown = [r for r in rows if r.fits][:top] + [r for r in rows if not r.fits][:top]
    for i, r in enumerate(shown, 1):
        c, m, t = r.candidate, r.memory, r.time
        kinds = ("params", "grads", "optimizer", "activations", "peak")
        gib = [f"{m[k] / GIB:7.2f}" if k in m else f"{'-':>7}" for k in kinds]
        lines.append(
            f"{i:>3} {c.dp_replicate:>6} {c.dp_shard:>6} {c.tp:>3} {c.pp:>3} {c.zero_stage:>4} "
            f"{c.activation_checkpointing:>4} {c.micro_batch_size:>3} {' '.join(gib)} "
            f"{t.step_s:8.3f} {t.exposed_comm_s:7.3f} {t.bubble_s:6.3f} {t.tokens_per_s:9.0f} "
            f"{t.mfu:5.2f}  {'yes' if r.fits else 'no: ' + r.reason}"
        )
    return "\n".join(lines)


def to_json(rows: list[PlanRow], top: int) -> str:
    return json.dumps([r.as_dict() for r in rows[:top]], indent=1)
