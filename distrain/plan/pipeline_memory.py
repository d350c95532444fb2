"""Per-rank memory of a pipeline layout, from the real stage split on fake tensors.

A pipeline schedule's `PipelineStage` objects do not build under `FakeTensorMode`, and the
schedule is not needed to know what a stage holds: each stage module this rank owns is cut by
`split_model` (the code training uses) from the meta-device model, laid out by the same function
`parallelize` lays its parts out with (`lay_out_parts`: tensor parallel, activation
checkpointing, FSDP2), materialized
as fake tensors, and stepped with as many microbatches in flight as the schedule keeps at its
peak, counted by memory.py's `LiveBytes`:

- gpipe: every microbatch's forward before the first backward: m;
- 1f1b: stage rank r of p runs p - r forwards before its first backward: min(m, p - r);
- interleaved_1f1b and zero_bubble (v stages per rank, torch's interleaved warm-up, as in
  Megatron's schedule, Narayanan et al. 2021): (v - 1) p + 2 (p - 1 - r) + 1 chunk-microbatches,
  at most v m, spread over the rank's chunks; zero_bubble's deferred weight-gradient passes may
  keep more, so its figure is a lower bound.

On top: the schedule's receive buffers, one per microbatch for each direction a stage receives
(activations into every stage but the first, their gradients into every stage but the last),
allocated at the first step and kept (torch.distributed.pipelining's stage infrastructure).
"""

from __future__ import annotations

import torch
from torch import nn

from distrain.family.spec import ModelSpec
from distrain.optim.builder import build_optimizer
from distrain.parallel.compress import CommStats
from distrain.parallel.parallelize import cut_stages, lay_out_parts
from distrain.parallel.run_plan import RunPlan
from distrain.parallel.tensor import tp_loss_context
from distrain.plan.build_results import PipelineMemory, in_flight
from distrain.plan.memory import (
    LiveBytes,
    fake_world,
    grad_bytes,
    held_optimizer_state_bytes,
    local_bytes,
)
from distrain.torch_compat import device_meshes_under_fake_mode


def estimate_pipeline_memory(plan: RunPlan, *, rank: int = 0) -> PipelineMemory:
    """Memory of rank `rank` of the pp layout `plan`, from fake steps of its stage modules."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, dims, spec = plan.config, plan.dims, plan.spec
    p, t = cfg.parallel, cfg.training
    dim = spec.shape(plan.model).dim
    assert dims.pp > 1
    if dims.cp > 1:
        raise NotImplementedError("the planner does not yet plan pipelines with cp")
    with fake_world(dims.world_size, rank):
        mesh, _ = dims.build_mesh("cpu")
        # Made before the fake mode, as the world mesh (parallelize's ep_mesh).
        ep_mesh = dims.build_ep_mesh("cpu") if dims.ep > 1 else None
        pp_rank = mesh["pp"].get_local_rank()
        with torch.device("meta"):
            meta = spec.build(plan.model)
        # Cut on meta, outside the fake mode (deep-copying a meta parameter inside it fails).
        parts, stage_ids, num_stages, microbatches = cut_stages(meta, plan, mesh)
        rows = plan.batch.local // microbatches
        with FakeTensorMode(allow_non_fake_inputs=True), device_meshes_under_fake_mode():
            parts = lay_out_parts(parts, plan, mesh, CommStats(), ep_mesh=ep_mesh)
            for part in parts:
                part.to_empty(device="cpu")
            kept = in_flight(p.pp_schedule, dims.pp, pp_rank, p.pp_stages_per_rank, microbatches)
            per_chunk = -(-kept // len(parts))
            params = sum(local_bytes(x) for part in parts for x in part.parameters())
            # The received activations and gradients live in the kept receive buffers (counted
            # as comm_buffers), made here before the count starts.
            # Under sequence parallelism a stage boundary carries this rank's sequence shard.
            shard = dims.tp if p.sequence_parallel and dims.tp > 1 else 1
            received = torch.empty(per_chunk, rows, t.seq_len // shard, dim)

            def step_stages(microbatches: torch.Tensor) -> None:
                # Under tp the last stage's logits are vocab-sharded: the loss runs as training's.
                with tp_loss_context(dims.tp > 1):
                    for part, stage_id in zip(parts, stage_ids, strict=True):
                        first, last = stage_id == 0, stage_id == num_stages - 1
                        _stage_steps(part, spec, first, last, microbatches, t.seq_len)

            # A first microbatch makes the gradients, which the schedule's steady state holds.
            step_stages(received[:1])
            grads = grad_bytes(x for part in parts for x in part.parameters())
            with LiveBytes(params + grads) as live:
                step_stages(received)
            optimizers = [build_optimizer(part, cfg.optim, spec=spec) for part in parts]
            for optimizer in optimizers:
                optimizer.step()
            optimizer_bytes = held_optimizer_state_bytes(optimizers)
            if dims.zero_stage == 1:
                # ZeroRedundancyOptimizer does not build on fake tensors: its state divided over
                # the data-parallel ranks, as built_rows.memory_of plans ZeRO-1 without pp.
                optimizer_bytes = -(-optimizer_bytes // (dims.world_size // (dims.tp * dims.pp)))
    boundary = (
        rows * t.seq_len * dim * 4 // dims.tp
        if p.sequence_parallel
        else (rows * t.seq_len * dim * 4)
    )
    receives = sum((s != 0) + (s != num_stages - 1) for s in stage_ids)
    return PipelineMemory(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes,
        activations=max(0, live.peak - params - grads),
        comm_buffers=receives * microbatches * boundary,
        in_flight=kept,
    )


def _stage_steps(
    part: nn.Module,
    spec: ModelSpec,
    first: bool,
    last: bool,
    received: torch.Tensor,
    seq_len: int,
) -> None:
    """One forward per microbatch in `received` (its activations, or token ids on the first
    stage), then their backwards, oldest first: the peak of 1F1B's steady state, every kept
    microbatch saved and one backward running. As in torch's schedules, a stage's output (the
    last stage's logits too, though the loss does not save them) is kept until its backward."""
    tokens = torch.zeros(received.shape[1], seq_len, dtype=torch.long)
    outputs = []
    for x in received:
        out = part(tokens if first else x.detach().requires_grad_())
        outputs.append((out, spec.loss(out, tokens) if last else out))
    for i in range(len(outputs)):
        (_, out), outputs[i] = outputs[i], None
        out.backward(None if last else received[i])
