"""THE layout rules: which combinations of config fields, model shape and world size distrain
runs, as one table.

`validate(cfg, world_size)` is called by `distrain train` before it starts any worker and again
by every worker (Trainer init), so a refusal costs no worker start and reads the same either way.
Each rule is data: what it needs to know, a predicate saying when it refuses, and a one-line
message naming the fields and what would work instead. With `--nnodes MIN:MAX` the world size is
known only at each rendezvous; the launcher then checks the rules that do not depend on it.

Ranges of single fields live with the schema (config/schema.py); data and paths are
launch/preflight.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from distrain.config.schema import Config
from distrain.data.corpus import is_token_data
from distrain.errors import ConfigError, MissingInput
from distrain.family.spec import FamilyModel, ModelShape, ModelSpec
from distrain.layout.facts import Facts
from distrain.models.registry import family_name, model_args, model_family
from distrain.parallel.device import CUDA_MISSING, device_type
from distrain.parallel.mesh import ParallelDims

# What a rule needs: the config and the model shape; also the world size; also the resolved
# degrees (ParallelDims, which the "world" rules make sure can be computed).
Needs = Literal["config", "world", "dims"]

_SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


class LayoutError(ConfigError):
    """A refused combination; `rule` names the rule (see RULES)."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class Rule:
    name: str
    needs: Needs
    refuses: Callable[[Facts], bool]
    message: str
    """A template formatted with the Facts as `f` (e.g. {f.p.tp}); one line."""


RULES: tuple[Rule, ...] = (
    # --- config and model shape ---
    Rule(
        "seq_len_within_model",
        "config",
        lambda f: f.t.seq_len > f.model.max_seq_len,
        "training.seq_len ({f.t.seq_len}) exceeds the model's max_seq_len ({f.model.max_seq_len},"
        " preset {f.cfg.model.preset!r}); lower training.seq_len to at most {f.model.max_seq_len}"
        ", or set model.max_seq_len = {f.t.seq_len} (learned positions then add parameters)",
    ),
    Rule(
        "tokenizer_needs_token_file",
        "config",
        # A data.path not there yet is preflight's to name (or train --check's to note).
        lambda f: (
            f.cfg.data.tokenizer != "bytes"
            and not is_token_data(f.cfg.data)
            and not _missing_locally(f.cfg.data.path)
        ),
        "data.tokenizer = {f.cfg.data.tokenizer!r} trains on token files: tokenize the text "
        "first (distrain prepare --tokenizer {f.cfg.data.tokenizer} --out DATA.bin TEXT...) and "
        "set data.path = DATA.bin",
    ),
    Rule(
        "vocab_holds_tokenizer",
        "config",
        # The byte tokenizer's ids are the data's own bytes, checked when the data is opened.
        lambda f: f.cfg.data.tokenizer != "bytes" and f.model.vocab_size < f.tokenizer_vocab,
        "model.vocab_size ({f.model.vocab_size}, preset {f.cfg.model.preset!r}) is smaller than "
        "the vocabulary of data.tokenizer = {f.cfg.data.tokenizer!r} ({f.tokenizer_vocab}); set "
        "model.vocab_size to at least {f.tokenizer_vocab} (e.g. {f.padded_vocab})",
    ),
    Rule(
        "cuda_available",
        "config",
        lambda f: f.cfg.run.device == "cuda" and not torch.cuda.is_available(),
        CUDA_MISSING,
    ),
    Rule(
        "oom_recovery_without_comm_hooks",
        "config",
        lambda f: f.t.oom_recovery and (f.c.gradient_compression != "none" or f.c.hierarchical),
        "training.oom_recovery all-reduces gradients itself after the last backward, so "
        "comm.gradient_compression ({f.c.gradient_compression!r}) and comm.hierarchical "
        "({f.c.hierarchical}) would be skipped; turn training.oom_recovery off, or set "
        "comm.gradient_compression = 'none' and comm.hierarchical = false",
    ),
    Rule(
        "comm_hooks_need_ddp",
        "config",
        lambda f: (f.c.gradient_compression != "none" or f.c.hierarchical) and f.sharded,
        "comm.gradient_compression and comm.hierarchical are DDP communication hooks; they need "
        "parallel.zero_stage 0/1 without tp/pp (zero_stage {f.p.zero_stage}, tp {f.p.tp}, pp "
        "{f.p.pp} here)",
    ),
    Rule(
        "one_comm_hook",
        "config",
        lambda f: f.c.gradient_compression != "none" and f.c.hierarchical,
        "comm.hierarchical cannot be combined with comm.gradient_compression (DDP takes one "
        "communication hook); choose one",
    ),
    Rule(
        "onebit_adam_plain_data_parallel",
        "config",
        lambda f: f.momentum_exchange_conflict != "",
        "optim.name = {f.cfg.optim.name!r} communicates the momentum itself; it does not compose "
        "with {f.momentum_exchange_conflict}. It runs with parallel.zero_stage 0, 1 or 2 without "
        "tp/pp, or zero_stage 0 with tp/pp, comm.gradient_compression = 'none' and "
        "training.oom_recovery off",
    ),
    Rule(
        "sgd_without_zero1",
        "config",
        lambda f: f.cfg.optim.name == "sgd" and f.p.zero_stage == 1,
        "optim.name = 'sgd' has no ZeRO-1 (its state is empty: there is nothing to shard); set "
        "parallel.zero_stage to 0, 2 or 3",
    ),
    Rule(
        "diloco_needs_fsdp",
        "config",
        lambda f: f.inner_steps > 0 and f.p.zero_stage <= 1,
        "diloco.inner_steps = {f.inner_steps} needs parallel.zero_stage 2 or 3: FSDP2 then "
        "reduces the gradients inside each site (over parallel.dp_shard) and leaves "
        "parallel.dp_replicate to the outer step, where DDP (zero_stage {f.p.zero_stage}) would "
        "average them over every site; set parallel.zero_stage = 2",
    ),
    Rule(
        "diloco_composes",
        "config",
        lambda f: f.diloco_conflict != "",
        "diloco.inner_steps = {f.inner_steps} does not compose with {f.diloco_conflict}; drop "
        "that setting or set diloco.inner_steps = 0",
    ),
    Rule(
        "replica_group_in_range",
        "config",
        lambda f: f.groups > 0 and f.cfg.fault_tolerance.group >= f.groups,
        "fault_tolerance.group = {f.cfg.fault_tolerance.group} is not one of the "
        "{f.groups} replica groups; set it to 0 .. {f.groups} - 1",
    ),
    Rule(
        "fault_tolerance_needs_fsdp",
        "config",
        lambda f: f.groups > 0 and f.p.zero_stage <= 1,
        "fault_tolerance.replica_groups = {f.groups} needs parallel.zero_stage 2 or 3: FSDP2 "
        "shards inside each group and the groups average its gradient shards; set "
        "parallel.zero_stage = 3",
    ),
    Rule(
        "fault_tolerance_composes",
        "config",
        lambda f: f.fault_tolerance_conflict != "",
        "fault_tolerance.replica_groups = {f.groups} does not compose with "
        "{f.fault_tolerance_conflict}; drop that setting or set fault_tolerance.replica_groups "
        "= 0",
    ),
    Rule(
        "fault_tolerance_needs_lighthouse",
        "config",
        lambda f: f.lighthouse_missing,
        "fault_tolerance.replica_groups = {f.groups} needs a lighthouse (distrain lighthouse): set "
        "fault_tolerance.lighthouse = 'http://host:port' or TORCHFT_LIGHTHOUSE",
    ),
    Rule(
        "fault_tolerance_needs_secret",
        "config",
        lambda f: f.secret_missing,
        "{f.secret_missing_message}",
    ),
    Rule(
        "diloco_fragments_fit",
        "config",
        lambda f: f.inner_steps > 0 and f.cfg.diloco.fragments > f.inner_steps,
        "diloco.fragments = {f.cfg.diloco.fragments} exceeds diloco.inner_steps = "
        "{f.inner_steps}: the fragments' outer steps are staggered over the inner steps; set "
        "diloco.fragments to {f.inner_steps} or less",
    ),
    Rule(
        "diloco_overlap_fits",
        "config",
        lambda f: (
            f.inner_steps > 0
            and f.cfg.diloco.overlap_steps >= max(1, f.inner_steps // f.cfg.diloco.fragments)
        ),
        "diloco.overlap_steps = {f.cfg.diloco.overlap_steps} must be below diloco.inner_steps "
        "// diloco.fragments = {f.inner_steps} // {f.cfg.diloco.fragments} (one fragment in "
        "flight at a time); lower it or raise diloco.inner_steps",
    ),
    Rule(
        "tp_needs_plan",
        "config",
        lambda f: f.p.tp > 1 and f.spec.tensor_plan is None,
        "parallel.tp ({f.p.tp}): the {f.spec.name!r} model family has no tensor-parallel plan; "
        "set parallel.tp = 1",
    ),
    Rule(
        "sequence_parallel_needs_plan",
        "config",
        lambda f: f.p.tp > 1 and f.p.sequence_parallel and not f.spec.sequence_parallel,
        "parallel.sequence_parallel: the {f.spec.name!r} model family's tensor-parallel plan has "
        "no sequence-parallel variant; set parallel.sequence_parallel = false",
    ),
    Rule(
        "cp_needs_attention",
        "config",
        lambda f: f.p.cp > 1 and f.spec.attention_modules is None,
        "parallel.cp ({f.p.cp}): the {f.spec.name!r} model family has no attention for context "
        "parallelism to split; set parallel.cp = 1",
    ),
    Rule(
        "lora_layouts_proven",
        "config",
        lambda f: f.lora_unproven[0] != "",
        "lora.rank ({f.cfg.lora.rank}) trains under DDP, FSDP2 (any parallel.zero_stage), tp, pp "
        "and replica groups, not yet with {f.lora_unproven[0]}: no test proves it; "
        "{f.lora_unproven[1]}, or set lora.rank = 0",
    ),
    Rule(
        "tp_splits_model",
        "config",
        lambda f: f.tp_uneven != "",
        "model.{f.tp_uneven} ({f.model_size}) must be divisible by parallel.tp ({f.p.tp}); choose "
        "parallel.tp in {{{f.tp_choices}}} or change model.{f.tp_uneven}",
    ),
    Rule(
        "sequence_parallel_splits_seq_len",
        "config",
        lambda f: f.p.tp > 1 and f.p.sequence_parallel and f.t.seq_len % f.p.tp != 0,
        "sequence parallelism splits the {f.t.seq_len} positions of a sequence over parallel.tp "
        "({f.p.tp}) ranks; use a training.seq_len that is a multiple of {f.p.tp}, or set "
        "parallel.sequence_parallel = false",
    ),
    Rule(
        "cp_splits_seq_len",
        "config",
        lambda f: f.p.cp > 1 and f.t.seq_len % f.cp_chunks != 0,
        "context parallelism cuts each sequence into 2 x parallel.cp = {f.cp_chunks} equal chunks "
        "(two per rank, for an even causal load); use a training.seq_len that is a multiple of "
        "{f.cp_chunks}, or a smaller parallel.cp",
    ),
    Rule(
        "cp_with_sequence_parallel",
        "config",
        lambda f: (
            f.p.cp > 1 and f.p.tp > 1 and f.p.sequence_parallel and f.cp_positions % f.p.tp != 0
        ),
        "sequence parallelism splits each context-parallel rank's {f.cp_positions} "
        "positions (training.seq_len / parallel.cp) over parallel.tp ({f.p.tp}) ranks; use a "
        "training.seq_len that is a multiple of {f.cp_tp}, or set "
        "parallel.sequence_parallel = false",
    ),
    Rule(
        "cp_composes_with_dp_tp",
        "config",
        lambda f: f.p.cp > 1 and f.cp_conflict != "",
        "parallel.cp = {f.p.cp} does not compose with {f.cp_conflict}; set parallel.cp = 1 "
        "or drop that setting",
    ),
    Rule(
        "single_stage_schedule",
        "config",
        lambda f: (
            f.p.pp > 1
            and f.p.pp_schedule in _SINGLE_STAGE_SCHEDULES
            and f.p.pp_stages_per_rank != 1
        ),
        "parallel.pp_schedule = {f.p.pp_schedule!r} runs one stage per rank but "
        "parallel.pp_stages_per_rank = {f.p.pp_stages_per_rank}; set it to 1 or use "
        "interleaved_1f1b or zero_bubble",
    ),
    Rule(
        "multi_stage_schedule",
        "config",
        lambda f: (
            f.p.pp > 1
            and f.p.pp_schedule not in _SINGLE_STAGE_SCHEDULES
            and f.p.pp_stages_per_rank < 2
        ),
        "parallel.pp_schedule = {f.p.pp_schedule!r} interleaves several stages per rank but "
        "parallel.pp_stages_per_rank = {f.p.pp_stages_per_rank}; set it to 2 or more or use "
        "gpipe or 1f1b",
    ),
    Rule(
        "a_layer_per_stage",
        "config",
        lambda f: f.p.pp > 1 and f.num_stages > f.model.n_layers,
        "model.n_layers ({f.model.n_layers}) must be at least the number of pipeline stages "
        "({f.num_stages} = parallel.pp x parallel.pp_stages_per_rank); lower parallel.pp or "
        "parallel.pp_stages_per_rank, or add layers",
    ),
    Rule(
        "ep_needs_experts",
        "config",
        lambda f: f.p.ep > 1 and f.num_experts == 0,
        "parallel.ep ({f.p.ep}) splits the experts of MoE layers, but the model has none "
        "(model.moe.num_experts = 0, preset {f.cfg.model.preset!r}); set model.moe.num_experts "
        "or parallel.ep = 1",
    ),
    Rule(
        "ep_splits_experts",
        "config",
        lambda f: f.p.ep > 1 and f.num_experts > 0 and f.num_experts % f.p.ep != 0,
        "model.moe.num_experts ({f.num_experts}) must be divisible by parallel.ep ({f.p.ep}); "
        "choose parallel.ep in {{{f.ep_choices}}} or change model.moe.num_experts",
    ),
    Rule(
        "ep_runs_on_fsdp",
        "config",
        lambda f: f.p.ep > 1 and f.ep_conflict != "",
        "{f.ep_conflict} replaces DDP's gradient all-reduce through a DDP communication hook, "
        "but parallel.ep = {f.p.ep} runs on FSDP2 (expert weights live on their own mesh), "
        "which has no such hook; change that setting or set parallel.ep = 1",
    ),
    Rule(
        "auto_micro_batch_needs_budget",
        "config",
        lambda f: (
            f.auto_micro_batch
            and f.t.memory_budget_gb is None
            and device_type(f.cfg.run.device) == "cpu"
        ),
        "training.micro_batch_size = 'auto' on CPU needs training.memory_budget_gb (the memory "
        "a rank may use, in GiB; on CUDA it defaults to the device's memory); set it, or set "
        "training.micro_batch_size to a number",
    ),
    Rule(
        "auto_micro_batch_without_pp",
        "config",
        lambda f: f.auto_micro_batch and f.p.pp > 1,
        "training.micro_batch_size = 'auto' runs its trial steps outside a pipeline schedule, "
        "so it does not apply with parallel.pp = {f.p.pp}; set training.micro_batch_size to a "
        "number (distrain plan ranks the sizes), or parallel.pp = 1",
    ),
    # --- the degrees against the world size ---
    Rule(
        "cp_divides_world",
        "world",
        lambda f: f.p.cp > 1 and f.world_size % f.cp_tp_pp != 0,
        "parallel.tp ({f.p.tp}) x parallel.pp ({f.p.pp}) x parallel.cp ({f.p.cp}) = "
        "{f.cp_tp_pp} does not divide the world size {f.world_size}; choose degrees whose "
        "product divides it, or run a multiple of {f.cp_tp_pp} processes",
    ),
    Rule(
        "tp_pp_divide_world",
        "world",
        lambda f: f.world_size % f.tp_pp != 0,
        "parallel.tp ({f.p.tp}) x parallel.pp ({f.p.pp}) = {f.tp_pp} does not divide the world "
        "size {f.world_size}; choose degrees whose product divides it, or run a multiple of "
        "{f.tp_pp} processes",
    ),
    Rule(
        "dp_shard_needs_fsdp",
        "world",
        lambda f: f.p.zero_stage <= 1 and f.p.dp_shard not in (-1, 1),
        "parallel.dp_shard = {f.p.dp_shard} needs parallel.zero_stage 2 or 3 (FSDP2); with "
        "zero_stage 0/1 data parallelism is replication: set dp_shard = 1 or -1",
    ),
    Rule(
        "dp_replicate_is_dp",
        "world",
        lambda f: f.p.zero_stage <= 1 and f.p.dp_replicate not in (-1, f.dp),
        "parallel.dp_replicate ({f.p.dp_replicate}) must equal the data-parallel size {f.dp} "
        "({f.dp_arithmetic}); set it to -1 (what is left over) "
        "or run {f.replicate_world} processes",
    ),
    Rule(
        "dp_replicate_divides_dp",
        "world",
        lambda f: (
            f.p.zero_stage >= 2
            and f.p.dp_shard == -1
            and f.p.dp_replicate != -1
            and f.dp % f.p.dp_replicate != 0
        ),
        "parallel.dp_replicate ({f.p.dp_replicate}) must divide the data-parallel size {f.dp} "
        "({f.dp_arithmetic}); choose one of {f.dp_divisors}",
    ),
    Rule(
        "dp_shard_divides_dp",
        "world",
        lambda f: (
            f.p.zero_stage >= 2
            and f.p.dp_replicate == -1
            and f.p.dp_shard != -1
            and f.dp % f.p.dp_shard != 0
        ),
        "parallel.dp_shard ({f.p.dp_shard}) must divide the data-parallel size {f.dp} "
        "({f.dp_arithmetic}); choose one of {f.dp_divisors}",
    ),
    Rule(
        "dp_degrees_fill_dp",
        "world",
        lambda f: (
            f.p.zero_stage >= 2
            and -1 not in (f.p.dp_replicate, f.p.dp_shard)
            and f.p.dp_replicate * f.p.dp_shard != f.dp
        ),
        "parallel.dp_replicate ({f.p.dp_replicate}) x parallel.dp_shard ({f.p.dp_shard}) must "
        "equal the data-parallel size {f.dp} ({f.dp_arithmetic}); "
        "set one of them to -1 (what is left over)",
    ),
    Rule(
        "ep_divides_dp",
        "world",
        lambda f: f.p.ep > 1 and f.dp % f.p.ep != 0,
        "parallel.ep ({f.p.ep}) must divide the data-parallel size {f.dp} ("
        "{f.dp_arithmetic}): expert-parallel ranks are data-parallel "
        "ranks; choose one of {f.dp_divisors}",
    ),
    # --- the resolved degrees ---
    Rule(
        "batch_splits_over_dp",
        "dims",
        lambda f: (
            not f.auto_micro_batch
            and f.t.global_batch_size % (f.t.micro_batch_size * f.dims.dp_size) != 0
        ),
        "training.global_batch_size ({f.t.global_batch_size}) must be a multiple of "
        "training.micro_batch_size ({f.t.micro_batch_size}) x data-parallel size "
        "({f.dims.dp_size}, from world size {f.world_size}); change the batch sizes or the "
        "number of processes",
    ),
    Rule(
        "auto_batch_splits_over_dp",
        "dims",
        lambda f: f.auto_micro_batch and f.t.global_batch_size % f.dims.dp_size != 0,
        "training.global_batch_size ({f.t.global_batch_size}) must be a multiple of the "
        "data-parallel size ({f.dims.dp_size}, from world size {f.world_size}) for "
        "training.micro_batch_size = 'auto' to split it; change the batch size or the number "
        "of processes",
    ),
    Rule(
        "batch_splits_over_survivors",
        "dims",
        lambda f: f.survivor_counts_not_splitting_batch != "",
        "training.global_batch_size ({f.t.global_batch_size}) cannot be split by "
        "{f.survivor_counts_not_splitting_batch} live replica group(s) of {f.dims.dp_size} "
        "data-parallel rank(s) in micro-batches of {f.survivor_split_unit}; make it a multiple of "
        "{f.survivors_batch_unit}",
    ),
    Rule(
        "pipeline_suits_survivors",
        "dims",
        lambda f: f.survivor_pipeline_refused != "",
        "parallel.pp_schedule = {f.p.pp_schedule!r} cannot run the pipeline of "
        "{f.survivor_pipeline_refused} per data-parallel rank ({f.num_stages} stages); "
        "make training.global_batch_size larger or the pipeline microbatches smaller",
    ),
    Rule(
        "diloco_needs_sites",
        "dims",
        lambda f: f.inner_steps > 0 and f.dims.dp_replicate < 2,
        "diloco.inner_steps = {f.inner_steps} averages over sites, the parallel.dp_replicate "
        "groups, but this layout has {f.dims.dp_replicate}; set "
        "parallel.dp_replicate to 2 or more, or diloco.inner_steps = 0",
    ),
    Rule(
        "ddp_detail_debug_on_gloo",
        "dims",
        lambda f: f.ddp_detail_on_gloo,
        # gloo only: torch 2.13's DDP segfaults in every worker under DETAIL on gloo (a plain
        # 2-rank DDP nn.Linear under torchrun shows it; tests/test_torch_faults.py proves it
        # still does, and fails once torch is fixed, to lift this rule). NCCL is not affected.
        "TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch 2.13's DDP crash on gloo (SIGSEGV in every "
        "worker, no error); unset it or set TORCH_DISTRIBUTED_DEBUG=INFO, or use a layout "
        "without DDP (parallel.zero_stage 2 or 3, tp or pp)",
    ),
    Rule(
        "pp_microbatches_split_batch",
        "dims",
        lambda f: f.p.pp > 1 and f.p.pp_microbatches > 0 and f.local_batch % f.p.pp_microbatches,
        "a local batch of {f.local_batch} sequences (training.global_batch_size / data-parallel "
        "size {f.dims.dp_size}) does not split into parallel.pp_microbatches = "
        "{f.p.pp_microbatches} equal microbatches; choose a divisor of {f.local_batch} or -1",
    ),
)


def _check(facts: Facts, needs: Needs) -> None:
    for rule in RULES:
        if rule.needs == needs and rule.refuses(facts):
            raise LayoutError(rule.name, rule.message.format(f=facts))


@dataclass(frozen=True)
class Layout:
    """What a valid config resolves to: the model family, the model's arguments and shape, and
    the degrees when the world size is known."""

    spec: ModelSpec
    model: object
    """The family's arguments (what `spec.build` takes)."""
    shape: ModelShape
    dims: ParallelDims | None

    @property
    def family_model(self) -> FamilyModel:
        return FamilyModel(self.spec, self.model)


def _missing_locally(path: str) -> bool:
    """A local data.path that does not exist (the default corpus, "", is always there)."""
    return path != "" and "://" not in path and not Path(path).exists()


def validate(cfg: Config, world_size: int | None, *, absent: list[str] | None = None) -> Layout:
    """Refuse (LayoutError, one line) the first rule `cfg` breaks on `world_size` ranks; with
    world_size None (elastic MIN:MAX) only the rules that do not depend on it. With `absent`
    (`train --check`), a file the config names that is not there is noted in it instead of
    refused: a tokenizer's vocabulary is then not checked, and a model.init_from folder's shape
    is replaced by model.preset's."""
    spec = model_family(family_name(cfg.model))
    try:
        args = model_args(cfg.model)
    except MissingInput as e:
        if absent is None:
            raise
        # model.preset's shape, or the family's first preset's where the preset is another
        # family's (the default one, with the folder the family's only model).
        preset = cfg.model.preset if cfg.model.preset in spec.presets else next(iter(spec.presets))
        absent.append(f"{e} (the rules were checked with model.preset {preset!r})")
        args = model_args(replace(cfg.model, init_from="", preset=preset))
    facts = Facts(cfg=cfg, spec=spec, model=spec.shape(args), absent=absent)
    _check(facts, "config")
    if world_size is None:
        return Layout(spec=spec, model=args, shape=facts.model, dims=None)
    facts = replace(facts, world_size=world_size)
    _check(facts, "world")
    dims = ParallelDims.from_config(
        cfg.parallel,
        world_size,
        optimizer_averages=facts.optimizer.replaces_wrapper,
        diloco=cfg.diloco.inner_steps > 0,
    )
    facts = replace(facts, dims=dims)
    _check(facts, "dims")
    return Layout(spec=spec, model=args, shape=facts.model, dims=facts.dims)
