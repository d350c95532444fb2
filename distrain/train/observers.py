"""The trainer's observers over what the parallel layer counts: gradient-communication bytes
(`CommMetrics`), DiLoCo's outer steps (`DiLoCoMetrics`), mixture-of-experts load statistics
(`MoEMetrics`) and the cross-replica consistency check of debug.check_replicas
(`ReplicaCheck`); and over the loader: its data wait and tokens per source (`DataMetrics`).
Each is a `StepObserver` (see observe/observer.py); the others (health, stragglers, profiler,
progress) live in observe/."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from distrain.data.loader import DistributedBatchLoader
from distrain.observe.observer import Row, StepObserver
from distrain.optim.diloco import DiLoCo
from distrain.parallel.compress import CommStats
from distrain.parallel.model import ParallelModel
from distrain.parallel.moe_stats import MoEStats
from distrain.parallel.sanity import check_all_replicas


class CommMetrics(StepObserver):
    """This rank's gradient-communication cost per step over the logging window, counted where
    each collective was issued (DDP hook, DDP's plain all-reduce, 1-bit Adam); nothing without
    data-parallel gradient communication."""

    def __init__(self, stats: CommStats):
        self.stats = stats

    def logged(self, row: Row, *, steps: int) -> None:
        snap = self.stats.snapshot()
        self.stats.reset()
        if not snap["fp32_equivalent_bytes"]:
            return
        row["comm_bytes"] = snap["bytes_sent"] / steps
        row["comm_fp32_bytes"] = snap["fp32_equivalent_bytes"] / steps
        row["comm_compression_ratio"] = snap["compression_ratio"]
        # Only hooks and 1-bit Adam time their collectives; DDP's plain all-reduce is counted
        # from its bucket sizes, untimed, so a window without a timed collective reports none.
        if snap["inflight_s"]:
            row["comm_inflight_s"] = snap["inflight_s"] / steps


class DataMetrics(StepObserver):
    """`data_wait_s`: this rank's mean wait for its batch per step over the logging window (0
    when the background loader keeps ahead); `data/tokens/NAME`: the target tokens each source
    has supplied to the run so far (every rank's count, the same on each)."""

    def __init__(self, loader: DistributedBatchLoader):
        self.loader = loader

    def logged(self, row: Row, *, steps: int) -> None:
        row["data_wait_s"] = self.loader.take_wait_s() / steps
        for name, tokens in self.loader.tokens_per_source().items():
            row[f"data/tokens/{name}"] = tokens


class DiLoCoMetrics(StepObserver):
    """DiLoCo: outer steps taken so far, the bytes this rank's outer steps sent per step over
    the window (as `CommMetrics` counts an all-reduce), and, when the window holds an outer
    step, the norm of its averaged pseudo-gradient and the sites' drift from it (the last
    one's; optim/diloco.py)."""

    def __init__(self, outer: DiLoCo):
        self.outer = outer

    def logged(self, row: Row, *, steps: int) -> None:
        outer = self.outer
        row["diloco_outer_steps"] = outer.outer_steps
        row["diloco_bytes"] = outer.take_bytes() / steps
        last = outer.take_last_step()
        if last is not None:
            row["diloco_pseudo_grad_norm"], row["diloco_drift"] = (float(x) for x in last)


class MoEMetrics(StepObserver):
    """Expert load balance and routing statistics of an MoE model over the window."""

    def __init__(self, stats: MoEStats):
        self.stats = stats

    def logged(self, row: Row, *, steps: int) -> None:
        row.update(self.stats.metrics())


class ReplicaCheck(StepObserver):
    """debug.check_replicas: at each logged step, parameters must agree across data-parallel
    replicas (and shared copies across tp ranks and tied pipeline stages). Collective."""

    def __init__(self, model: ParallelModel, mesh: DeviceMesh):
        self.model, self.mesh = model, mesh

    def logged(self, row: Row, *, steps: int) -> None:
        check_all_replicas(self.model, self.mesh)
