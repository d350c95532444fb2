"""Per-rank memory of one layout, measured on the real build without real memory.

The model is built by `build_parallel_model` (the code training uses: the same pipeline split,
tensor parallel plan, activation checkpointing, DDP/FSDP2 wrapping) and trained for a step under
`FakeTensorMode` (tensors carry shapes, no storage) and torch's fake process group of the planned
world size (collectives return at once). `LiveBytes` counts the storage of every tensor the step
creates until it is freed, so the peak follows whatever the build does, including presets and
wrappers added later. (torch's MemTracker does the same with a per-module breakdown, at several
times the cost per op and a 15 s import; the planner needs only the total.)

Breakdown per rank:
- params, grads, optimizer: bytes of this rank's local parts at rest (a DTensor counts its local
  shard); under DDP gradients are views into its communication buckets, so the bucket memory is
  this figure;
- activations: the fwd/bwd peak above params and grads: saved activations plus transient buffers
  (FSDP2's all-gathered parameters, the loss, temporaries);
- peak: the largest live total over forward, backward (optimizer state held) and the optimizer
  step.
Activations grow linearly with the micro-batch, so two fake steps (micro-batch 1 and 2) give the
peak for any micro-batch size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distrain.config.schema import Config
from distrain.layout.rules import validate
from distrain.optim.builder import build_optimizer
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext
from distrain.parallel.local import local_tensor
from distrain.parallel.model import ParallelModel, build_parallel_model
from distrain.parallel.run_plan import RunPlan
from distrain.torch_compat import (
    device_meshes_under_fake_mode,
    dtensor_storage,
    forget_dtensor_meshes,
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. The fwd/bwd peak at micro-batch size b is fixed + b x per_sample (params
    and gradients included, optimizer state not)."""

    params: int
    grads: int
    optimizer: int
    fixed: int
    per_sample: int
    opt_step_peak: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def activations(self, micro_batch_size: int) -> int:
        return max(0, self.fixed + micro_batch_size * self.per_sample - self.params - self.grads)

    def peak(self, micro_batch_size: int) -> int:
        fwd_bwd = self.fixed + micro_batch_size * self.per_sample + self.optimizer
        return max(fwd_bwd, self.opt_step_peak, self.model_states)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, counting what ops create inside the mode
    (each storage once, until the storage is freed) on top of `baseline`. Works on fake tensors.
    The release is tied to the storage's Python object, which torch keeps as long as the storage
    lives: a gradient that autograd holds in `.grad` after the tensor that brought it is gone
    stays counted."""

    def __init__(self, baseline: int = 0):
        super().__init__()
        self.live = self.peak = baseline
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view (or in-place result) shares an input's storage: no new bytes, even when that
        # input was made before the mode (a parameter's transpose). A DTensor op runs its local
        # op below this mode, unseen: its output's local tensor is what it made (tp and sp
        # activations are DTensors).
        inputs = {
            self._key(dtensor_storage(t))
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = dtensor_storage(t).untyped_storage()
            key = storage._cdata
            if key in self._seen or key in inputs:
                continue
            self._seen.add(key)
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def local_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def held_optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Tensor state the optimizers hold on this rank now (ZeroRedundancyOptimizer: its
    partition), as measured after a step; train/autobatch.py's `optimizer_state_bytes` predicts
    Adam's moments before the first step allocates them."""
    total = 0
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", optimizer)
        for state in inner.state.values():
            total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Torch's fake process group of `world_size` ranks, as rank `rank`, for this block; it must
    be the only default group of this process (the planner runs before any real one). DTensor's
    caches forget its meshes when it ends."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_meshes()


def planned_run(cfg: Config, world_size: int) -> RunPlan:
    """The `RunPlan` a fake build of `cfg` on `world_size` ranks is made from (the layout rules
    checked): training.precision "auto" is planned as bf16, what it becomes on the GPUs the
    planner prices, and "auto" compile as this machine decides it (eager on CPU)."""
    layout = validate(cfg, world_size)
    if cfg.training.precision == "auto":
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, precision="bf16"))
    return RunPlan.decided(
        cfg, spec=layout.spec, model=layout.model, dims=layout.dims, device=torch.device("cpu")
    )


def _tokens(rows: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device=device)
    return tokens, tokens


def estimate_memory(cfg: Config, world_size: int, *, rank: int = 0) -> MemoryEstimate:
    """Memory of rank `rank` when `cfg` trains on `world_size` ranks, from a fake step. The step
    runs eager: compiled kernels cannot run on fake tensors (training.compile is planned as off,
    whatever it says)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, compile=False, micro_batch_size=1)
    )
    plan = planned_run(cfg, world_size)
    dims = plan.dims
    with fake_world(world_size, rank):
        ctx = DistContext(
            rank=rank,
            local_rank=0,
            world_size=world_size,
            device=torch.device("cpu"),
            backend="fake",
        )
        mesh, dp_mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            meta_model = plan.spec.build(plan.model)
        with FakeTensorMode(allow_non_fake_inputs=True), device_meshes_under_fake_mode():
            return _fake_step(plan, mesh, dp_mesh, ctx, meta_model)


def _fake_step(plan, mesh, dp_mesh, ctx, meta_model) -> MemoryEstimate:  # noqa: ANN001
    """Build (for micro-batch 1), then one fwd/bwd at micro-batch 1 and 2 (the activation
    slope) and the optimizer step; every pipeline micro-batch of the schedule is in flight
    together (the worst stage)."""
    cfg, dims = plan.config, plan.dims
    model = build_parallel_model(plan, mesh, dp_mesh, ctx, CommStats(), meta_model=meta_model)
    optimizers = [
        build_optimizer(
            part,
            cfg.optim,
            spec=plan.spec,
            zero1_group=dp_mesh.get_group() if dims.zero_stage == 1 else None,
            dp_group=dp_mesh.get_group(),
        )
        for part in model.parts
    ]
    return measure_step(model, optimizers, cfg.training.seq_len, ctx.device)


def grad_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients `parameters` hold on this rank (local shards of DTensors)."""
    return sum(local_bytes(p.grad) for p in parameters if p.grad is not None)


def measure_step(
    model: ParallelModel,
    optimizers: list[torch.optim.Optimizer],
    seq_len: int,
    device: torch.device,
) -> MemoryEstimate:
    """Live-byte peaks of fwd/bwd at micro-batch 1 and 2, then of the optimizer step; on fake
    tensors (the planner) or real ones (the tests' measurement), counted the same way. A first
    pass makes the gradients, which stay held in the baseline of each measured pass, as under
    accumulation: counted from their creation instead, a small micro-batch's peak would fall
    at the end of backward (the gradients, not the activations) and the slope would not be the
    activations'."""
    params = sum(local_bytes(p) for p in model.parameters())
    model.forward_backward([_tokens(1, seq_len, device)], lambda loss: loss)
    grads = grad_bytes(model.parameters())
    peaks = []
    for rows in (1, 2):
        with LiveBytes(params + grads) as live:
            model.forward_backward([_tokens(rows, seq_len, device)], lambda loss: loss)
        peaks.append(live.peak)
    with LiveBytes(params + grads) as live:
        for optimizer in optimizers:
            optimizer.step()
    optimizer_bytes = held_optimizer_state_bytes(optimizers)
    per_sample = peaks[1] - peaks[0]
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes,
        fixed=peaks[0] - per_sample,
        per_sample=per_sample,
        opt_step_peak=max(live.peak, params + grads + optimizer_bytes),
    )
