"""DDP communication hooks: gradient compression (fp16, bf16, PowerSGD, 1-bit sign with error
feedback) and a topology-aware hierarchical all-reduce, each counting the bytes it issues.

This module owns the hooks and their byte/time accounting (`CommStats`); it creates no process
groups (distrain/mesh.py does) and registers nothing (the caller does
`ddp.register_comm_hook(*build_comm_hook(...))`).

No `from __future__ import annotations` here: DDP checks a hook's `bucket` annotation with
`inspect.signature`, which would see the string "dist.GradBucket" and refuse the hook.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

Future = torch.futures.Future
Hook = Callable[[Any, dist.GradBucket], Future[torch.Tensor]]
COMM_HOOK_KINDS = ("none", "fp16", "bf16", "powersgd", "onebit")
_FP32_BYTES = 4


class CommStats:
    """What this rank's gradient collectives cost since the last `reset()`.

    bytes_sent: payload bytes handed to collectives, counted where each one is issued: the
        tensor's nbytes for an all-reduce, reduce or broadcast, the input's nbytes for an
        all-gather. It is not the wire cost: a ring all-reduce moves 2(N-1)/N x payload per rank,
        an all-gather (N-1) x input, so compare kinds with the same collective by this number.
    fp32_equivalent_bytes: what a plain fp32 all-reduce of the same gradient buckets would have
        issued, so `compression_ratio` = fp32_equivalent_bytes / bytes_sent.
    comm_time_s: summed over collectives, time from issue to completion (time.perf_counter, the
        end taken in the collective future's completion callback). Collectives overlap with
        backward and with each other, so this is busy time of the communication, not step time.
        PowerSGD's three chained all-reduces (and the small matmuls between them) count as one.

    Completion callbacks run on the backend's threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = 0
            self.fp32_equivalent_bytes = 0
            self.comm_time_s = 0.0

    @property
    def compression_ratio(self) -> float:
        return self.fp32_equivalent_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "fp32_equivalent_bytes": self.fp32_equivalent_bytes,
                "compression_ratio": self.compression_ratio,
                "comm_time_s": self.comm_time_s,
            }

    def add_completed(self, nbytes: int, *, fp32_values: int, seconds: float) -> None:
        """Count a collective issued and waited for by the caller (1-bit Adam's exchanges)."""
        with self._lock:
            self.bytes_sent += nbytes
            self.fp32_equivalent_bytes += fp32_values * _FP32_BYTES
            self.comm_time_s += seconds

    def add_bucket(self, numel: int) -> None:
        """Record a gradient bucket of `numel` elements (its plain fp32 all-reduce cost)."""
        with self._lock:
            self.fp32_equivalent_bytes += numel * _FP32_BYTES

    def issued(self, nbytes: int, fut: Future, issued_at: float) -> Future:
        """Count `nbytes` issued at `issued_at`; the returned future completes with `fut` after
        adding the elapsed time to comm_time_s."""
        with self._lock:
            self.bytes_sent += nbytes

        def done(f: Future) -> Any:
            elapsed = time.perf_counter() - issued_at
            with self._lock:
                self.comm_time_s += elapsed
            return f.value()

        return fut.then(done)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup, stats: CommStats) -> Future:
    start = time.perf_counter()
    work = dist.all_reduce(t, group=group, async_op=True)
    return stats.issued(t.nbytes, work.get_future(), start)


def _done(value: torch.Tensor) -> Future[torch.Tensor]:
    fut: Future[torch.Tensor] = Future()
    fut.set_result(value)
    return fut


@dataclass
class HookState:
    """State of the stateless hooks: where to reduce and where to count."""

    process_group: dist.ProcessGroup
    stats: CommStats


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP's default (fp32 sum all-reduce, then mean), counted."""
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel())
    buf.div_(state.process_group.size())
    return _all_reduce(buf, state.process_group, state.stats).then(lambda f: f.value()[0])


def _cast_allreduce(
    state: HookState, bucket: dist.GradBucket, dtype: torch.dtype
) -> Future[torch.Tensor]:
    """torch's fp16_compress_hook semantics: divide in the low precision before summing (so the
    sum cannot overflow), all-reduce, copy back into the bucket."""
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel())
    compressed = buf.to(dtype).div_(state.process_group.size())

    def decompress(fut: Future) -> torch.Tensor:
        return buf.copy_(fut.value()[0])

    return _all_reduce(compressed, state.process_group, state.stats).then(decompress)


def fp16_cast_hook(state: HookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    return _cast_allreduce(state, bucket, torch.float16)


def bf16_cast_hook(state: HookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Our own: torch's bf16_compress_hook refuses CPU tensors, though gloo sums bf16 fine. DDP
    refuses any hook of that name off CUDA/XPU, hence "cast" in these names."""
    return _cast_allreduce(state, bucket, torch.bfloat16)


@dataclass
class PowerSGDHookState:
    powersgd: powersgd.PowerSGDState
    stats: CommStats


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """torch's powerSGD_hook, counted exactly without re-implementing it.

    Before start_powerSGD_iter it issues one fp32 all-reduce of the bucket. After, it issues
    three: the uncompressed tensors (vectors, and matrices PowerSGD would not shrink), P and Q.
    Their element count is what the hook adds to the state's `total_numel_after_compression`
    (uncompressed numel, plus (n + m) x rank per compressed n x m matrix) before any of them is
    issued, so the difference across the call, times the element size, is the payload exactly.

    torch's hook issues the P and Q all-reduces from completion callbacks, on the backend's
    threads; with several buckets in flight two ranks can issue them in different orders, and
    gloo pairs collectives by issue order (seen: SIGABRT "Received data size doesn't match" with
    4 buckets). So each bucket's chain completes before the next bucket's starts; that gives up
    overlapping PowerSGD's communication with backward.
    """
    inner = state.powersgd
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel())
    vanilla = inner.iter < inner.start_powerSGD_iter
    numel_before = inner.total_numel_after_compression
    start = time.perf_counter()
    fut = powersgd.powerSGD_hook(inner, bucket)
    numel = buf.numel() if vanilla else inner.total_numel_after_compression - numel_before
    return _done(state.stats.issued(numel * buf.element_size(), fut, start).wait())


_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_signs(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Signs of `t` (flattened) as bits, 8 per uint8, most significant first; 1 means >= 0 (zero
    counts as positive so every element decodes to +-1). Returns (packed, numel)."""
    bits = (t.reshape(-1) >= 0).to(torch.uint8)
    numel = bits.numel()
    bits = torch.nn.functional.pad(bits, (0, -numel % 8)).view(-1, 8)
    return (bits << _BIT_SHIFTS.to(t.device)).sum(dim=1, dtype=torch.uint8), numel


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The +-1 fp32 tensor of `numel` elements that `pack_signs` encoded."""
    bits = (packed.unsqueeze(-1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :numel].float() * 2 - 1


def onebit_compress(
    tensor: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error-feedback sign compression: (packed signs, scale, new residual).

    The gradient plus the error left over from last time is sent as scale x sign, scale the mean
    absolute value (so the decompressed tensor keeps the l1 norm). What compression loses goes
    into the new residual, so nothing is dropped, only delayed: decompressed + new_residual equals
    tensor + residual up to one fp32 rounding of the subtraction (exactly when Sterbenz's lemma
    applies, scale/2 <= |x| <= 2 scale). All in fp32 whatever the bucket's dtype.
    """
    corrected = tensor.float().reshape(-1) + residual
    scale = corrected.abs().mean()
    packed, numel = pack_signs(corrected)
    return packed, scale, corrected - scale * unpack_signs(packed, numel)


@dataclass
class OneBitState:
    process_group: dist.ProcessGroup
    stats: CommStats
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """This rank's compression error per bucket index, added to the next step's gradient."""
    layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """The parameters (data pointers, in order) each residual belongs to. DDP rebuilds its
    buckets after the first iteration, so an index can come to mean other parameters."""


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """All-gather every rank's packed signs and scale, decompress each and average.

    Signs don't add, so this can't be an all-reduce; the scale rides in the last 4 bytes of the
    packed buffer so each bucket costs one collective of ceil(numel / 8) + 4 bytes per rank.
    Every rank sums the same contributions in the same order, so replicas stay identical.
    """
    buf = bucket.buffer()
    numel, index = buf.numel(), bucket.index()
    state.stats.add_bucket(numel)
    layout = tuple(p.data_ptr() for p in bucket.parameters())
    residual = state.residuals.get(index)
    if residual is None or state.layouts.get(index) != layout:
        # New bucket, or rebuilt: the old error can't be mapped onto it; it is one step's worth.
        residual = torch.zeros(numel, device=buf.device)
        state.layouts[index] = layout
    packed, scale, state.residuals[index] = onebit_compress(buf, residual)
    payload = torch.cat([packed, scale.reshape(1).view(torch.uint8)])
    group = state.process_group
    gathered = [torch.empty_like(payload) for _ in range(group.size())]
    start = time.perf_counter()
    work = dist.all_gather(gathered, payload, group=group, async_op=True)

    def decompress(fut: Future) -> torch.Tensor:
        everyone = torch.stack(gathered)
        scales = everyone[:, -4:].contiguous().view(torch.float32)
        mean = (scales * unpack_signs(everyone[:, :-4], numel)).mean(dim=0)
        return buf.copy_(mean.view_as(buf))

    return state.stats.issued(payload.nbytes, work.get_future(), start).then(decompress)


def build_comm_hook(
    kind: str,
    *,
    process_group: dist.ProcessGroup,
    stats: CommStats,
    powersgd_rank: int = 2,
    powersgd_start_iter: int = 2,
) -> tuple[Any, Hook]:
    """(state, hook) for `ddp.register_comm_hook(state, hook)`; kind is one of COMM_HOOK_KINDS.

    PowerSGD starts compressing at iteration `powersgd_start_iter` (torch's default, 1000, would
    compress nothing in a short run); before that it all-reduces in fp32, which also lets DDP
    rebuild its buckets first. Error feedback and warm start are on, as the paper recommends.
    """
    if kind == "none":
        return HookState(process_group, stats), allreduce_hook
    if kind == "fp16":
        return HookState(process_group, stats), fp16_cast_hook
    if kind == "bf16":
        return HookState(process_group, stats), bf16_cast_hook
    if kind == "powersgd":
        inner = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
            use_error_feedback=True,
            warm_start=True,
        )
        return PowerSGDHookState(inner, stats), powersgd_hook
    if kind == "onebit":
        return OneBitState(process_group, stats), onebit_hook
    raise ValueError(f"unknown comm hook {kind!r}; choose one of {', '.join(COMM_HOOK_KINDS)}")


@dataclass
class HierarchicalState:
    """Groups for a two-level all-reduce, made by every rank in the same order (mesh.py).

    intra_group: the ranks of this node; inter_group: the node leaders (local rank 0 of each
    node), None on the other ranks; leader_global_rank: this node's leader, as a global rank.
    """

    intra_group: dist.ProcessGroup
    inter_group: dist.ProcessGroup | None
    leader_global_rank: int
    world_size: int
    stats: CommStats


def hierarchical_all_reduce(tensor: torch.Tensor, state: HierarchicalState) -> torch.Tensor:
    """Average `tensor` over the world in place: reduce to the node leader over the fast
    intra-node links, all-reduce among leaders (the only traffic on the slow inter-node network,
    one copy per node instead of one per rank), broadcast back inside the node.

    Each stage waits for the one before it. The stages could be chained in completion callbacks,
    but those run on the backend's threads in whatever order buckets finish, and gloo/NCCL pair
    collectives by issue order per group: ranks could then match different buckets' collectives.
    Issuing in DDP's bucket order from the calling thread keeps every rank in step.
    """
    stats, leader = state.stats, state.leader_global_rank
    start = time.perf_counter()
    work = dist.reduce(tensor, dst=leader, group=state.intra_group, async_op=True)
    stats.issued(tensor.nbytes, work.get_future(), start).wait()
    if state.inter_group is not None:
        _all_reduce(tensor, state.inter_group, stats).wait()
    start = time.perf_counter()
    work = dist.broadcast(tensor, src=leader, group=state.intra_group, async_op=True)
    stats.issued(tensor.nbytes, work.get_future(), start).wait()
    return tensor.div_(state.world_size)


def hierarchical_allreduce_hook(
    state: HierarchicalState, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """DDP hook form of `hierarchical_all_reduce` (same result as the default, up to the order
    of fp32 additions)."""
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel())
    return _done(hierarchical_all_reduce(buf, state))
