"""What watches the training loop from outside a step: `StepObserver`, the one interface the
loop calls, in a fixed order on every rank. Health counters, straggler detection, the profiler,
communication and MoE statistics, replica checks and the progress display each hang off it, so
the loop reads as data -> step -> observe -> checkpoint, with no branch per observer.

At a logged step the loop builds the metrics row (loss, learning rate, gradient norm, speed) and
passes it to each observer's `logged` in turn: an observer adds its own metrics to the row or
reads what earlier ones added. Observers that gather across ranks (stragglers, replica checks)
run there on every rank, which is why every rank calls `logged`, not only the one that writes.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


class StepObserver:
    """No-op defaults: an observer overrides what it needs."""

    def start(self, step: int) -> None:
        """The loop begins after `step` steps (0, or the resumed checkpoint's step)."""

    def before_step(self, step: int) -> None:
        """`step` (1-based) is about to run."""

    def after_step(self, step: int) -> None:
        """`step`'s optimizer update is done; it is not yet logged."""

    def logged(self, row: Row, *, steps: int) -> None:
        """A logged step: `row` is its metrics row so far, `steps` the steps since the last
        logged one; add metrics to it in place."""

    def step_end(self, step: int) -> None:
        """`step` is over: logged, evaluated and checkpointed as due."""

    def close(self) -> None:
        """The run ended, well or not."""
