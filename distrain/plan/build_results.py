"""What the planner's fake builds report, and the arithmetic the memory model shares with them:
memory.py's `MemoryEstimate` (one layout's step on one rank) and pipeline_memory.py's
`PipelineMemory` (one pp rank), the results the build store keeps, and a step's estimate
extrapolated in depth from two (`at_depth`); `accumulates` (whether a rank's step holds its
first micro-batch's gradients through the others) and `in_flight` (the microbatches a pipeline
schedule keeps at once: pipeline_memory.py's docstring).

Apart from the builds, so that a plan that reads every build from the store (search.py,
built_rows.py, memory_model.py) never imports the training stack the builds run (DTensor, FSDP2,
the optimizers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distrain.config.schema import ParallelConfig, TrainingConfig
from distrain.parallel.mesh import data_parallel_size

MOMENTS = ("", "second_", "steep_")
"""The three moments of a fwd/bwd whose lines make its peak (memory.py's `peak_lines`), by field
prefix."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. The fwd/bwd peak at micro-batch size b (params and the gradients
    included, optimizer state not) is the largest of three lines, fixed + b x per_sample: with
    the gradients held (`fixed`, `per_sample`: the moment highest at micro-batch 1; `second_*`:
    at 2; `steep_*`: the moment growing fastest), and for a step's first micro-batch, which
    starts without them (`first_*`, the same moments of that pass)."""

    params: int
    grads: int
    optimizer: int
    fixed: int
    per_sample: int
    second_fixed: int
    second_per_sample: int
    steep_fixed: int
    steep_per_sample: int
    first_fixed: int
    first_per_sample: int
    first_second_fixed: int
    first_second_per_sample: int
    first_steep_fixed: int
    first_steep_per_sample: int
    opt_step_peak: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def _line_peak(self, prefix: str, micro_batch_size: int) -> int:
        return max(
            getattr(self, f"{prefix}{m}fixed")
            + micro_batch_size * getattr(self, f"{prefix}{m}per_sample")
            for m in MOMENTS
        )

    def fwd_bwd(self, micro_batch_size: int, *, accumulating: bool) -> int:
        """The fwd/bwd peak of a step of one micro-batch, or of several (`accumulating`: the
        later ones hold the first one's gradients)."""
        first = self._line_peak("first_", micro_batch_size)
        if not accumulating:
            return first
        return max(first, self._line_peak("", micro_batch_size))

    def steep_fwd_bwd(self, micro_batch_size: int, *, accumulating: bool) -> int:
        """`fwd_bwd` of the moment growing fastest with the micro-batch alone (every block's
        activations live: what a deeper stack's peak comes to; memory_model.Coefficients)."""
        prefixes = ("first_", "")[: 1 + accumulating]
        return max(
            getattr(self, f"{p}steep_fixed")
            + micro_batch_size * getattr(self, f"{p}steep_per_sample")
            for p in prefixes
        )

    def activations(self, micro_batch_size: int, *, accumulating: bool) -> int:
        peak = self.fwd_bwd(micro_batch_size, accumulating=accumulating)
        return max(0, peak - self.params - self.grads)

    def peak(self, micro_batch_size: int, *, accumulating: bool) -> int:
        fwd_bwd = self.fwd_bwd(micro_batch_size, accumulating=accumulating) + self.optimizer
        return max(fwd_bwd, self.opt_step_peak, self.model_states)


def at_depth(
    builds: tuple[MemoryEstimate, MemoryEstimate], depths: tuple[int, int], blocks: int
) -> MemoryEstimate:
    """The estimate of a stack of `blocks` blocks from two builds at `depths` blocks: every
    field on its line through the two (a moment's line is right where the moment is the same at
    both depths: the steepest, `steep_fwd_bwd`)."""
    (low, high), (one, two) = depths, builds
    return MemoryEstimate(
        **{
            f.name: round(
                getattr(one, f.name)
                + (getattr(two, f.name) - getattr(one, f.name)) * (blocks - low) / (high - low)
            )
            for f in dataclasses.fields(MemoryEstimate)
        }
    )


def accumulates(t: TrainingConfig, p: ParallelConfig, world_size: int) -> bool:
    """Whether a rank training as `t` in the layout `p` on `world_size` ranks runs more than one
    micro-batch a step (its share of the global batch over the micro-batch), so that its later
    micro-batches hold the gradients of the first."""
    return t.global_batch_size // data_parallel_size(p, world_size) > t.micro_batch_size


@dataclass(frozen=True)
class PipelineMemory:
    """Bytes of one pp rank: model states at rest, the fwd/bwd peak of the schedule's in-flight
    microbatches above params and grads, the kept receive buffers, and the peak."""

    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    in_flight: int

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm_buffers


def in_flight(schedule: str, pp: int, pp_rank: int, stages_per_rank: int, microbatches: int) -> int:
    """Chunk-microbatches whose activations rank `pp_rank` holds at once (module docstring)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - pp_rank)
    v = stages_per_rank
    return min(v * microbatches, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
