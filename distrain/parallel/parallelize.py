"""Applying a parallel layout to a plain model, in one fixed order: `parallelize`, which returns
the finished `ParallelModel` (model.py) of this rank.

build on meta -> pipeline split (pp) -> LoRA adapters (lora.rank > 0: parallel/lora.py) ->
context parallel (cp) -> tensor/sequence parallel (tp)
-> expert parallel (ep) -> activation checkpointing -> compile -> FSDP2 (ZeRO 2/3, and whenever
tp/pp/ep is on) -> materialize + seeded init (identical values under every layout) -> DDP
(ZeRO 0/1).

Every step that needs to know the model reads it from the model family's `ModelSpec`
(family/spec.py): the family builds and initializes the model, names its blocks and its
first- and last-stage submodules, and gives its tensor-parallel plan, tied weights, MoE layers
and Hugging Face adapter. Nothing here knows a family. What the layout reads of the run is the
plan's sections (`RunPlan.training`, `.parallel`, `.comm`, `.init_from`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.errors import ConfigError
from distrain.parallel.activation_checkpointing import apply_activation_checkpointing
from distrain.parallel.compile import apply_compile
from distrain.parallel.compress import CommStats
from distrain.parallel.context import apply_context_parallel
from distrain.parallel.data_parallel import apply_ddp, apply_fsdp, install_comm_hook
from distrain.parallel.device import DistContext
from distrain.parallel.lora import (
    apply_lora,
    base_source,
    frozen_names,
    init_lora,
    lora_targets,
    place_lora_under_tp,
)
from distrain.parallel.mesh import embedding_group
from distrain.parallel.model import DDPSettling, ParallelModel
from distrain.parallel.moe_stats import MoEStats
from distrain.parallel.run_plan import RunPlan


def parallelize(
    plan: RunPlan,
    mesh: DeviceMesh,
    dp_mesh: DeviceMesh,
    ctx: DistContext,
    comm_stats: CommStats,
    *,
    meta_model: nn.Module | None = None,
    ep_mesh: DeviceMesh | None = None,
) -> ParallelModel:
    """The model parts for this rank, finished: the model of `plan` (its family's, from its
    arguments) laid out per its parallel degrees; gradient communication (DDP's hook, or the
    model itself for DDP's plain all-reduce) counts its bytes into `comm_stats`. `meta_model`:
    the model already built on the meta device (the planner builds it before it enters its
    fake-tensor mode, in which module parameters could not be swapped by to_empty); `ep_mesh`:
    the expert-parallel mesh already built (the planner's, made before that mode too: a
    DeviceMesh reads its rank map, which that mode leaves without values), else built here
    under ep."""
    device, spec, dims = ctx.device, plan.spec, plan.dims
    t, comm = plan.training, plan.comm
    if meta_model is None:
        with torch.device("meta"):
            meta_model = spec.build(plan.model)
    moe_settings = spec.moe_settings(plan.model)
    lora = plan.config.lora
    if lora.rank:
        # Refused here, on the whole model, when a target names none of its linears.
        lora_targets(meta_model, spec, plan.model, lora.target_modules)
    parts, stage_ids, num_stages, microbatches = cut_stages(meta_model, plan, mesh)
    for part in parts:
        apply_lora(part, spec, plan.model, lora, strict=False)
    if ep_mesh is None and dims.ep > 1:
        ep_mesh = dims.build_ep_mesh(device.type, timeout_s=comm.collective_timeout_s)
    # Whole-model compile only where nothing inside the model would be traced across blocks.
    plain = dims.world_size == dims.dp_size and dims.ep == 1
    compile_whole = (
        t.compile
        and plain
        and dims.dp_wrapper != "fsdp"
        and moe_settings is None
        and t.activation_checkpointing == "none"
    )
    parts = lay_out_parts(
        parts, plan, mesh, comm_stats, ep_mesh=ep_mesh, compile_whole=compile_whole
    )
    _materialize(parts, plan, device)
    ddp = None
    if dims.dp_wrapper == "ddp":
        dp_mesh = dims.gradient_mesh(mesh, dp_mesh)
        parts = [
            apply_ddp(part, dp_mesh, bucket_cap_mb=comm.bucket_cap_mb, device=device)
            for part in parts
        ]
        ddp = DDPSettling(
            rows=plan.batch.micro,
            seq_len=t.seq_len,
            install_hook=functools.partial(
                install_comm_hook,
                dp_mesh=dp_mesh,
                comm=comm,
                stats=comm_stats,
                local_world_size=ctx.local_world_size,
                timeout_s=comm.collective_timeout_s,
            ),
        )
    tied_names = spec.tied_weights(meta_model)
    moe_stats = None
    if moe_settings is not None:
        moe_stats = MoEStats(
            parts,
            moe_layers=spec.moe_layers,
            dp_group=dp_mesh.get_group(),
            device=device,
            args=moe_settings,
        )
    return ParallelModel(
        parts,
        dims=dims,
        mesh=mesh,
        batch=plan.batch,
        precision=t.precision,
        pp_schedule=plan.parallel.pp_schedule,
        device=device,
        stage_ids=stage_ids,
        num_stages=num_stages,
        pp_microbatches=microbatches,
        spec=spec,
        comm_stats=comm_stats,
        loss_in_model=compile_whole and spec.loss_in_forward,
        tied=(
            (embedding_group(mesh, timeout_s=comm.collective_timeout_s), tied_names)
            if dims.pp > 1 and tied_names is not None
            else None
        ),
        moe_stats=moe_stats,
        ddp=ddp,
    )


def cut_stages(
    model: nn.Module, plan: RunPlan, mesh: DeviceMesh
) -> tuple[list[nn.Module], list[int], int, int]:
    """(parts, their stage ids, stages in all, pipeline microbatches): the whole model as one
    part without a pipeline, else the stages this pp rank holds, cut by the family's spec (the
    planner's pipeline memory cuts its stages here too)."""
    dims = plan.dims
    if dims.pp == 1:
        return [model], [0], 1, 1
    from distrain.parallel.pipeline import split_model
    from distrain.parallel.stages import stage_ids_for_rank

    p = plan.parallel
    num_stages = dims.pp * p.pp_stages_per_rank
    stage_ids = stage_ids_for_rank(
        mesh["pp"].get_local_rank(), dims.pp, p.pp_stages_per_rank, p.pp_schedule
    )
    parts = [split_model(model, s, num_stages, spec=plan.spec) for s in stage_ids]
    microbatches = p.pp_microbatches if p.pp_microbatches > 0 else plan.batch.accumulation
    return parts, stage_ids, num_stages, microbatches


def lay_out_parts(
    parts: list[nn.Module],
    plan: RunPlan,
    mesh: DeviceMesh,
    comm_stats: CommStats,
    *,
    ep_mesh: DeviceMesh | None = None,
    compile_whole: bool = False,
) -> list[nn.Module]:
    """The layout's steps after the pipeline cut, on parts still on the meta device, in the one
    order of the module docstring: context, tensor and expert parallelism, activation
    checkpointing and compile per part, then FSDP2 (the planner's pipeline memory builds its
    stages through here too)."""
    for part in parts:
        _apply_layout(part, plan, mesh, ep_mesh, comm_stats, compile_whole)
    if plan.dims.dp_wrapper != "fsdp":
        return parts
    return [
        apply_fsdp(
            part,
            mesh,
            plan.dims,
            precision=plan.training.precision,
            blocks=getattr(part, plan.spec.blocks),
            expert_mesh=None if ep_mesh is None else ep_mesh["dp_mod_ep"],
        )
        for part in parts
    ]


def _apply_layout(
    part: nn.Module,
    plan: RunPlan,
    mesh: DeviceMesh,
    ep_mesh: DeviceMesh | None,
    comm_stats: CommStats,
    compile_whole: bool,
) -> None:
    """Context, tensor and expert parallelism, activation checkpointing and compile, in that
    order, on one part still on the meta device."""
    t, p, dims, spec = plan.training, plan.parallel, plan.dims, plan.spec
    blocks = getattr(part, spec.blocks)
    if dims.cp > 1:
        # A family without attention is refused by the layout rules (cp_needs_attention).
        assert spec.attention_modules is not None
        apply_context_parallel(
            part,
            spec.attention_modules(part),
            mesh["cp"],
            p.cp_method,
            stage_seq_len=t.seq_len if dims.pp > 1 else None,
        )
    if dims.tp > 1:
        from distrain.parallel.tensor import apply_tensor_parallel

        frozen = frozen_names(part)
        apply_tensor_parallel(part, mesh["tp"], sequence_parallel=p.sequence_parallel, spec=spec)
        place_lora_under_tp(part, frozen)
    if ep_mesh is not None:
        from distrain.parallel.experts import apply_expert_parallel

        apply_expert_parallel(spec.moe_layers(part), ep_mesh["ep"], stats=comm_stats)
    apply_activation_checkpointing(blocks, t.activation_checkpointing, every=t.ac_every_layers)
    if t.compile:
        apply_compile(part, whole=compile_whole, blocks=blocks)


def _materialize(parts: list[nn.Module], plan: RunPlan, device: torch.device) -> None:
    """Storage on `device` for every part, then the family's seeded init (the same values on
    every layout), from model.init_from's pretrained weights when it names them."""
    spec = plan.spec
    source = None
    if plan.init_from:
        if spec.hf is None:
            raise ConfigError(
                f"model.init_from: the {spec.name!r} model family reads no pretrained weights; "
                "remove model.init_from"
            )
        source = base_source(spec.hf.source(plan.init_from, plan.model))
    for part in parts:
        part.to_empty(device=device)
        spec.init_weights(part, plan.model, plan.training.seed, source=source)
        init_lora(part, plan.training.seed)
