"""Profiling: torch.profiler traces of chosen steps and ranks, with named ranges per phase.

`PhaseRanges` listens to the heartbeat's phase marks and keeps one `record_function` range open
per phase (distrain/data, distrain/forward, distrain/backward, distrain/optimizer, distrain/log,
distrain/eval, distrain/checkpoint), so traces show them without code of their own in the loop;
on CUDA the same ranges go to NVTX, so Nsight Systems shows them too. `StepProfiler` runs
torch.profiler from `profile.start_step` for `profile.num_steps` steps on `profile.ranks` and
writes <run_dir>/profiles/rank<N>/trace.json (Chrome trace format: Perfetto, chrome://tracing),
a top-operator table in the rank log, and with `profile.memory` on CUDA a memory snapshot for
PyTorch's memory visualizer (memory_snapshot.pickle).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from distrain.config.schema import ProfileConfig
from distrain.errors import ConfigError
from distrain.files import make_dir, write_with
from distrain.observe.observer import StepObserver


def profiled_ranks(text: str, world_size: int) -> set[int]:
    """profile.ranks: "all" or comma-separated rank numbers."""
    if text.strip() == "all":
        return set(range(world_size))
    try:
        ranks = {int(part) for part in text.split(",")}
    except ValueError:
        raise ConfigError(
            f"profile.ranks = {text!r}: expected 'all' or comma-separated ranks, e.g. '0,3'"
        ) from None
    if not all(0 <= r < world_size for r in ranks):
        raise ConfigError(f"profile.ranks = {text!r}: ranks must be in [0, {world_size})")
    return ranks


class PhaseRanges:
    """One open profiler (and on CUDA, NVTX) range for the current phase."""

    def __init__(self, device: torch.device):
        self.nvtx = device.type == "cuda"
        self._open: record_function | None = None

    def on_phase(self, phase: str) -> None:
        self.close()
        self._open = record_function(f"distrain/{phase}")
        self._open.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(f"distrain/{phase}")

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
            if self.nvtx:
                torch.cuda.nvtx.range_pop()


class StepProfiler(StepObserver):
    """Starts torch.profiler when step `start_step` begins and stops it after `num_steps`."""

    def __init__(
        self,
        cfg: ProfileConfig,
        *,
        run_dir: Path,
        rank: int,
        world_size: int,
        device: torch.device,
        logger: logging.Logger,
    ):
        self.cfg, self.device, self.log = cfg, device, logger
        self.enabled = cfg.start_step > 0 and rank in profiled_ranks(cfg.ranks, world_size)
        self.run_dir, self.out_sub = Path(run_dir), f"profiles/rank{rank}"
        self._profiler: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        """Call as `step` (1-based) begins."""
        if not self.enabled or step != self.cfg.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.cfg.memory:
                torch.cuda.memory._record_memory_history()
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=self.cfg.memory
        )
        self._profiler.__enter__()

    def step_end(self, step: int) -> None:
        if self._profiler is None or step < self.cfg.start_step + self.cfg.num_steps - 1:
            return
        self.stop()

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        trace = make_dir(self.run_dir, self.out_sub) / "trace.json"
        write_with(trace, profiler.export_chrome_trace)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=10)
        self.log.info("profile of %d step(s) written to %s\n%s", self.cfg.num_steps, trace, table)
        if self.device.type == "cuda" and self.cfg.memory:
            write_with(trace.with_name("memory_snapshot.pickle"), torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
