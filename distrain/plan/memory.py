"""Per-rank memory of one layout, measured on the real build without real memory.

The model is built by `parallelize` (the code training uses: the same pipeline split,
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
A step's first micro-batch starts without gradients (the trainer zeroes them to None), and its
peak can fall anywhere from the end of forward to the end of backward, where the gradients are
all made; a step that accumulates holds every gradient through each later micro-batch. Both are
read from one fwd/bwd: `LiveBytes` records the live total after every op and when each storage
was made, and the moment-by-moment total with the gradients held is the same total with each
gradient counted from the start instead of from the op that made it (a pass with them really
held gives the same peak to the byte on the planner's presets; tests/test_plan.py). Every
moment's total grows linearly with the micro-batch, so two passes (micro-batch 1 and 2, the same
ops, paired by `moments`) give each moment's line, and the peak at any micro-batch is the
highest of them: kept as three lines, the moments highest at micro-batch 1 and at 2 and the one
growing fastest (`peak_lines`). The passes follow an uncounted first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distrain.optim.builder import build_optimizer
from distrain.optim.diloco import outer_optimizer
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext
from distrain.parallel.local import local_tensor
from distrain.parallel.model import ParallelModel
from distrain.parallel.parallelize import parallelize
from distrain.parallel.run_plan import RunPlan
from distrain.plan.build_results import MOMENTS, MemoryEstimate
from distrain.plan.planned import replanned
from distrain.torch_compat import (
    device_meshes_under_fake_mode,
    dtensor_storage,
    forget_dtensor_meshes,
)

Line = tuple[int, int]


def peak_lines(one: list[int], two: list[int]) -> tuple[Line, Line, Line]:
    """(fixed, per sample) of three moments of a pass run at micro-batch 1 (`one`: the live
    total at each moment) and 2 (`two`, the same moments: `moments`): the moment highest at
    micro-batch 1, the one highest at 2, and the one growing fastest (ties: the higher), whose
    lines bound the peak at any micro-batch from below and meet it at 1, at 2 and at large
    micro-batches. Passes that could not be matched moment by moment fall back to the line
    through their peaks."""
    if len(one) != len(two) or not one:
        slope = max(two, default=0) - max(one, default=0)
        line = (max(one, default=0) - slope, slope)
        return line, line, line
    picked = (
        max(range(len(one)), key=lambda i: (one[i], two[i])),
        max(range(len(one)), key=lambda i: (two[i], two[i] - one[i])),
        max(range(len(one)), key=lambda i: (two[i] - one[i], one[i])),
    )
    return tuple((one[i] - (two[i] - one[i]), two[i] - one[i]) for i in picked)


RESYNC_WINDOW = 32
"""How many ops past a difference either pass may run before the two must agree again."""
RESYNC_OPS = 4
"""Ops in a row the passes must agree on to be back in step."""


def moments(one_ops: list[Any], two_ops: list[Any]) -> list[tuple[slice, slice]] | None:
    """The two passes' ops paired into moments: a moment is one op both ran, or a stretch where
    they differ (a batch of one takes a view where a batch of two splits and concatenates), as
    one moment of each side's stretch; None where they part for longer than RESYNC_WINDOW."""
    found, i, j = [], 0, 0
    while i < len(one_ops) and j < len(two_ops):
        if one_ops[i] == two_ops[j]:
            found.append((slice(i, i + 1), slice(j, j + 1)))
            i, j = i + 1, j + 1
            continue
        step = _back_in_step(one_ops, two_ops, i, j)
        if step is None:
            return None
        found.append((slice(i, i + step[0]), slice(j, j + step[1])))
        i, j = i + step[0], j + step[1]
    if i < len(one_ops) or j < len(two_ops):
        found.append((slice(i, len(one_ops)), slice(j, len(two_ops))))
    return found


def _back_in_step(one: list[Any], two: list[Any], i: int, j: int) -> tuple[int, int] | None:
    """The fewest ops (di, dj) after which the passes agree on RESYNC_OPS ops (or both end)."""
    for total in range(1, 2 * RESYNC_WINDOW + 1):
        for di in range(max(0, total - RESYNC_WINDOW), min(total, RESYNC_WINDOW) + 1):
            dj = total - di
            if one[i + di : i + di + RESYNC_OPS] == two[j + dj : j + dj + RESYNC_OPS]:
                return di, dj
    return None


def at_moments(totals: list[int], spans: list[slice]) -> list[int]:
    """The live total at each moment: the highest over its ops (one that ran no op: the total
    before it)."""
    return [
        max(totals[span]) if span.stop > span.start else totals[max(0, span.start - 1)]
        for span in spans
    ]


BUFFERS = {"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
"""Ops that make a buffer for the caller to fill rather than compute a result."""


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, counting what ops create inside the mode
    (each storage once, until the storage is freed) on top of `baseline`. Works on fake tensors.
    The release is tied to the storage's Python object, which torch keeps as long as the storage
    lives: a gradient that autograd holds in `.grad` after the tensor that brought it is gone
    stays counted. With `record`: `ops` and `totals`, each op and the live total after it, and
    `made`, the op index at which each storage now alive was made (by its key, `storage_key`)."""

    def __init__(self, baseline: int = 0, *, record: bool = False):
        super().__init__()
        self.live = self.peak = baseline
        self.record = record
        self.ops: list[Any] = []
        self.totals: list[int] = []
        self.made: dict[int, int] = {}
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view (or in-place result) shares an input's storage: no new bytes, even when that
        # input was made before the mode (a parameter's transpose). A DTensor op runs its local
        # op below this mode, unseen: its output's local tensor is what it made (tp and sp
        # activations are DTensors).
        inputs = {
            storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
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
            if self.record:
                self.made[key] = len(self.totals)
        if self.record:
            self.ops.append(func)
            self.totals.append(self.live)
        return out

    def with_held(self, storages: dict[int, int]) -> list[int]:
        """`totals` as if `storages` (key -> bytes: the gradients, made during the recorded
        pass) had been alive from its start: each is counted before the op that made it too.
        When accumulating, a new gradient lives beside the held one until it is added: one that
        autograd computed (and, the first time, kept as `.grad`) until the engine adds it, so
        the one computed last is counted twice until the next is made; one that a wrapper
        fills into a buffer of its own (FSDP2's reduce-scatter output, made by `empty`) is
        counted twice at that op, where the buffer, the held gradients and what is being
        reduced are all alive, and is added before anything else is made."""
        made = sorted((self.made[key], nbytes) for key, nbytes in storages.items())
        totals, not_yet, newest, k = [], sum(storages.values()), 0, 0
        for index, live in enumerate(self.totals):
            buffer = False
            while k < len(made) and made[k][0] <= index:
                not_yet -= made[k][1]
                newest = made[k][1]
                buffer = self.ops[index]._schema.name in BUFFERS
                k += 1
            totals.append(live + not_yet + newest)
            if buffer:
                newest = 0
        return totals


def storage_key(t: torch.Tensor) -> int:
    """The identity of the storage `t` (a DTensor: its local tensor) lives in."""
    return dtensor_storage(t).untyped_storage()._cdata


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


def _tokens(rows: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device=device)
    return tokens, tokens


def estimate_memory(plan: RunPlan, *, rank: int = 0) -> MemoryEstimate:
    """Memory of rank `rank` of `plan`, from a fake step. The step runs eager: compiled kernels
    cannot run on fake tensors (training.compile is planned as off, whatever it says)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    training = dataclasses.replace(plan.config.training, compile=False, micro_batch_size=1)
    plan = replanned(plan, training=training)
    dims = plan.dims
    with fake_world(dims.world_size, rank):
        ctx = DistContext(
            rank=rank,
            local_rank=0,
            world_size=dims.world_size,
            device=torch.device("cpu"),
            backend="fake",
        )
        mesh, dp_mesh = dims.build_mesh("cpu")
        # Before the fake mode: a DeviceMesh reads its rank map, which that mode leaves without
        # values (parallelize's ep_mesh).
        ep_mesh = dims.build_ep_mesh("cpu") if dims.ep > 1 else None
        with torch.device("meta"):
            meta_model = plan.spec.build(plan.model)
        with FakeTensorMode(allow_non_fake_inputs=True), device_meshes_under_fake_mode():
            return _fake_step(plan, mesh, dp_mesh, ctx, meta_model, ep_mesh)


def _fake_step(plan, mesh, dp_mesh, ctx, meta_model, ep_mesh) -> MemoryEstimate:  # noqa: ANN001
    """Build (for micro-batch 1), then one fwd/bwd at micro-batch 1 and 2 (the activation
    slope) and the optimizer step; every pipeline micro-batch of the schedule is in flight
    together (the worst stage)."""
    cfg, dims = plan.config, plan.dims
    model = parallelize(
        plan, mesh, dp_mesh, ctx, CommStats(), meta_model=meta_model, ep_mesh=ep_mesh
    )
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
    found = measure_step(model, optimizers, cfg.training.seq_len, ctx.device)
    if cfg.diloco.inner_steps == 0:
        return found
    return with_outer_step(found, plan, mesh, model)


def with_outer_step(
    found: MemoryEstimate, plan: RunPlan, mesh: DeviceMesh, model: ParallelModel
) -> MemoryEstimate:
    """`found` with DiLoCo's outer optimizer (optim/diloco.py) made over this rank's shards and
    its first outer step run, as the trainer runs it after an inner step (the gradients
    zeroed): what it still holds afterwards (the fp32 global weights and momentum, and with
    diloco.overlap_steps the fragment in flight) counts as optimizer state, at every moment of
    the step, and the outer step's peak as an optimizer step's."""
    cfg = plan.config
    for p in model.parameters():
        p.grad = None
    at_rest = found.params + found.optimizer
    # Its first outer step is not the run's last (which would take every fragment at once).
    steps = cfg.diloco.inner_steps + 1
    with LiveBytes(at_rest) as live:
        outer = outer_optimizer(
            cfg.diloco,
            plan.dims,
            mesh,
            model,
            total_steps=steps,
            bucket_cap_mb=cfg.comm.bucket_cap_mb,
        )
        outer.after_step(cfg.diloco.inner_steps)
    held = live.live - at_rest
    return dataclasses.replace(
        found,
        optimizer=found.optimizer + held,
        opt_step_peak=max(found.opt_step_peak + held, live.peak),
    )


def grad_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients `parameters` hold on this rank (local shards of DTensors)."""
    return sum(local_bytes(p.grad) for p in parameters if p.grad is not None)


def measure_step(
    model: ParallelModel,
    optimizers: list[torch.optim.Optimizer],
    seq_len: int,
    device: torch.device,
) -> MemoryEstimate:
    """Live-byte lines of fwd/bwd at micro-batch 1 and 2, each pass started without gradients
    as a step's first micro-batch is (and read again with them held: `LiveBytes.with_held`),
    then the peak of the optimizer step; on fake tensors (the planner) or real ones (the tests'
    measurement), counted the same way."""
    params = sum(local_bytes(p) for p in model.parameters())
    # Outside the count, a first step: what it makes once for good (FSDP2's unsharded
    # parameters, resized to nothing between uses but counted at their full size when made),
    # and the order FSDP2 records for its prefetching, which every later step follows (a first
    # backward without it peaked one block's parameters lower on `gpt2-tiny`).
    model.forward_backward([_tokens(1, seq_len, device)], lambda loss: loss)
    passes = []
    for rows in (1, 2):
        for p in model.parameters():
            p.grad = None
        with LiveBytes(params, record=True) as live:
            model.forward_backward([_tokens(rows, seq_len, device)], lambda loss: loss)
        storages = {
            storage_key(p.grad): dtensor_storage(p.grad).untyped_storage().nbytes()
            for p in model.parameters()
            if p.grad is not None
        }
        passes.append((live.ops, live.totals, live.with_held(storages)))
    (one_ops, *one), (two_ops, *two) = passes
    paired = moments(one_ops, two_ops)
    if paired is not None:
        one = [at_moments(totals, [a for a, _ in paired]) for totals in one]
        two = [at_moments(totals, [b for _, b in paired]) for totals in two]
    lines = {}
    for prefix, at_one, at_two in (("first_", one[0], two[0]), ("", one[1], two[1])):
        for moment, (fixed, per_sample) in zip(MOMENTS, peak_lines(at_one, at_two), strict=True):
            lines[f"{prefix}{moment}fixed"] = fixed
            lines[f"{prefix}{moment}per_sample"] = per_sample
    grads = grad_bytes(model.parameters())
    with LiveBytes(params + grads) as live:
        for optimizer in optimizers:
            optimizer.step()
    optimizer_bytes = held_optimizer_state_bytes(optimizers)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes,
        opt_step_peak=max(live.peak, params + grads + optimizer_bytes),
        **lines,
    )
