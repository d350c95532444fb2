"""The trainer's observers over what the parallel layer counts: communication bytes
(`CommMetrics`), DiLoCo's outer steps (`DiLoCoMetrics`), mixture-of-experts load statistics
(`MoEMetrics`) and the cross-replica consistency check of debug.check_replicas
(`ReplicaCheck`); and over the loader: its data wait and tokens per source (`DataMetrics`).
Each is a `StepObserver` (see observe/observer.py); the others (health, stragglers, profiler,
progress) live in observe/."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.device_mesh import DeviceMesh

from distrain.data.loader import DistributedBatchLoader
from distrain.observe.observer import Row, StepObserver
from distrain.optim.diloco import DiLoCo
from distrain.parallel.comm_record import RecordCollectives
from distrain.parallel.compress import CommStats
from distrain.parallel.model import ParallelModel
from distrain.parallel.moe_stats import MoEStats
from distrain.parallel.sanity import check_all_replicas


class CommMetrics(StepObserver):
    """This rank's communication per step over the logging window (`comm_bytes`): what the
    gradient collectives sent, counted where each was issued (DDP hook, DDP's plain all-reduce,
    1-bit Adam, expert parallelism's all-to-all), with the ratio against a plain fp32
    all-reduce; and, with `record_layout`, what the layout's own collectives send each step
    (FSDP2's all-gathers and reduce-scatters, tp's, cp's, pipeline sends, the gradient norm's),
    recorded once, over this process's second step (parallel/comm_record.py: they are the same
    every step; the first also sets up, e.g. a pipeline's shapes), less what `counted()` (the
    counts above, and DiLoCo's outer steps') grew by in that step; that part is also its own
    figure, `comm_layout_bytes`. `comm_compression_ratio` is the gradient collectives' alone."""

    def __init__(self, stats: CommStats, *, record_layout: bool, counted: Callable[[], float]):
        self.stats, self.record_layout, self.counted = stats, record_layout, counted
        self.layout_bytes: float | None = None
        """What the layout's collectives send per step, once recorded."""
        self._recording: tuple[RecordCollectives, float] | None = None
        self._record_step = 0

    def start(self, step: int) -> None:
        self._record_step = step + 2

    def before_step(self, step: int) -> None:
        if self.record_layout and step == self._record_step:
            recorder = RecordCollectives()
            self._recording = (recorder, self.counted())
            recorder.__enter__()

    def after_step(self, step: int) -> None:
        if self._recording is None:
            return
        recorder, counted_before = self._recording
        recorder.__exit__(None, None, None)
        self._recording = None
        self.layout_bytes = max(0.0, recorder.wire_bytes() - (self.counted() - counted_before))

    def close(self) -> None:
        """A step that raised ends the run inside the recording: leave no mode behind."""
        if self._recording is not None:
            self._recording[0].__exit__(None, None, None)
            self._recording = None

    def logged(self, row: Row, *, steps: int) -> None:
        snap = self.stats.snapshot()
        self.stats.reset()
        layout = self.layout_bytes or 0.0
        if not snap["fp32_equivalent_bytes"] and not layout:
            return
        row["comm_bytes"] = snap["bytes_sent"] / steps + layout
        if layout:
            row["comm_layout_bytes"] = layout
        if not snap["fp32_equivalent_bytes"]:
            return
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
        row["comm_bytes"] = row.get("comm_bytes", 0.0) + row["diloco_bytes"]
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
