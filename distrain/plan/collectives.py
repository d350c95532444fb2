"""Collective cost as measured on this machine: an alpha-beta model per kind of collective.

`distrain plan --calibrate` times all-reduce, all-gather, reduce-scatter, broadcast and a
send/recv pair on a real 2-process group of this machine's default backend (gloo on CPU, NCCL on
GPUs) at several message sizes, and fits seconds = latency + bytes x seconds-per-byte per kind
(least squares over the sizes, each size's median of the repeats). A plan then prices a
collective of a group of n ranks with ring scaling from the measured group of g ranks: latency x
(n - 1) / (g - 1) (a ring takes n - 1 steps) and the byte term x ((n - 1) / n) / ((g - 1) / g)
(the share of the message each rank moves). Bytes are the full message: the all-reduced tensor,
the all-gather's output, the reduce-scatter's input, the tensor sent.

The same processes measure how far a rank's collectives progress while it computes
(`time_concurrency`): an all-reduce alone, a run of matmuls as long alone, then both at once (the
all-reduce started asynchronously, the matmuls run, the all-reduce waited on). The share of the
shorter of the two that the pair saved is the concurrency: near 1 where the collective has its own
engine (a GPU's NCCL kernels on their own stream), lower where it competes with the compute for
the same cores (gloo's threads beside a CPU rank's compute thread).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20)


@dataclass(frozen=True)
class LinkCost:
    """seconds = latency_s + nbytes x s_per_byte, measured on a group of group_size ranks."""

    latency_s: float
    s_per_byte: float
    group_size: int

    def seconds(self, nbytes: float, group_size: int) -> float:
        if group_size <= 1:
            return 0.0
        if self.group_size <= 1:
            return self.latency_s + nbytes * self.s_per_byte
        steps = (group_size - 1) / (self.group_size - 1)
        share = ((group_size - 1) / group_size) / ((self.group_size - 1) / self.group_size)
        return self.latency_s * steps + nbytes * self.s_per_byte * share

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def fit(sizes: list[float], seconds: list[float], group_size: int) -> LinkCost:
    """Least-squares line through (bytes, seconds), both coefficients kept >= 0 (a negative
    intercept is noise on a bandwidth-bound link: refit through the origin). A slope that comes
    out <= 0 means timing noise on a loaded machine hid the byte term; bytes are never free, so
    the cheapest time is taken as the latency and the spread of the times over the spread of
    the sizes as the byte term."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / var
    if slope <= 0:
        latency = min(seconds)
        slope = (max(seconds) - latency) / (max(sizes) - min(sizes))
        return LinkCost(latency_s=latency, s_per_byte=slope, group_size=group_size)
    latency = mean_y - slope * mean_x
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in zip(sizes, seconds, strict=True)) / sum(x * x for x in sizes)
    return LinkCost(latency_s=latency, s_per_byte=slope, group_size=group_size)


def time_collective(kind: str, nbytes: int, repeats: int, device: torch.device) -> float:
    """Median seconds of one collective of `nbytes` over the default group (all ranks call), the
    slowest rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = nbytes // 4
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // world, device=device)
    times = []
    for i in range(repeats + 2):  # two untimed: connection set-up, buffer allocation
        dist.barrier()
        start = time.perf_counter()
        if kind == "all_reduce":
            dist.all_reduce(full)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(full, piece)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(piece, full)
        elif kind == "broadcast":
            dist.broadcast(full, src=0)
        elif rank == 0:  # send_recv: one message each way, half the round trip
            dist.send(full, dst=1)
            dist.recv(full, src=1)
        elif rank == 1:
            dist.recv(full, src=0)
            dist.send(full, dst=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if i >= 2:
            times.append(elapsed / 2 if kind == "send_recv" else elapsed)
    # The slowest rank's median: a collective ends for the group when its last rank is done.
    value = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


CONCURRENCY_BYTES = 16 * 2**20
"""The all-reduce `time_concurrency` hides: a gradient bucket's size (comm.bucket_cap_mb 25) in
fp32, rounded down."""


def time_concurrency(nbytes: int, repeats: int, device: torch.device) -> float:
    """The share of the shorter of an all-reduce of `nbytes` and a matmul run as long that
    running them at once saves (the module docstring), in [0, 1]: the median over `repeats`, the
    least of the group's ranks."""
    full = torch.ones(nbytes // 4, device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def matmuls(count: int) -> None:
        for _ in range(count):
            a @ b

    for _ in range(2):  # untimed: connection set-up, buffers, kernel selection
        timed(lambda: dist.all_reduce(full))
        timed(lambda: matmuls(1))
    comm = statistics.median(timed(lambda: dist.all_reduce(full)) for _ in range(repeats))
    one = statistics.median(timed(lambda: matmuls(8)) for _ in range(repeats)) / 8
    count = max(1, round(comm / one))
    # Every rank runs as many matmuls: rank 0's count.
    agreed = torch.tensor([count], device=device)
    dist.broadcast(agreed, src=0)
    count = int(agreed.item())

    def both() -> None:
        work = dist.all_reduce(full, async_op=True)
        matmuls(count)
        work.wait()

    shares = []
    for _ in range(repeats):
        alone_comm = timed(lambda: dist.all_reduce(full))
        alone_compute = timed(lambda: matmuls(count))
        together = timed(both)
        saved = alone_comm + alone_compute - together
        shares.append(min(1.0, max(0.0, saved / min(alone_comm, alone_compute))))
    value = torch.tensor([statistics.median(shares)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def _worker(rank: int, world: int, store_path: str, repeats: int, out: dict) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        found = {
            kind: [time_collective(kind, size, repeats, device) for size in SIZES] for kind in KINDS
        }
        found["concurrency"] = time_concurrency(CONCURRENCY_BYTES, repeats, device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.update(found)


@dataclass(frozen=True)
class Measured:
    """What `measure_collectives` found: the fitted cost of each kind and the concurrency."""

    costs: dict[str, LinkCost]
    concurrency: float


def measure_collectives(world_size: int = 2, repeats: int = 10) -> Measured:
    """Fitted cost of each kind, and the concurrency, on `world_size` fresh processes of this
    machine."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(
            _worker,
            args=(world_size, os.path.join(tmp, "store"), repeats, out),
            nprocs=world_size,
        )
        measured = dict(out)
    costs = {kind: fit([float(s) for s in SIZES], measured[kind], world_size) for kind in KINDS}
    return Measured(costs, measured["concurrency"])
