"""Rank 0's progress display. On a terminal: a tqdm bar (log lines are written around it, see
logs.py). Anywhere else (a pipe, a file, a CI log) a redrawn bar is a line per update, so it is a
plain log line instead, at logging steps, at most one per PLAIN_PERCENT of the run (or per
PLAIN_MAX_GAP_S, whichever comes first), and at the end."""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from typing import TextIO

from tqdm import tqdm

from distrain.observe.observer import Row, StepObserver

PLAIN_PERCENT = 10
PLAIN_MAX_GAP_S = 300.0


class Progress(StepObserver):
    def __init__(
        self,
        *,
        total: int,
        enabled: bool,
        logger: logging.Logger,
        initial: int | None = None,
        stream: TextIO | None = None,
    ):
        """Shown from step `initial` on; with None, from the step the loop starts at."""
        self.stream = sys.stderr if stream is None else stream
        self.total, self.log = total, logger
        self.enabled = enabled
        self.bar = None
        self._postfix: dict[str, str] = {}
        self._due = False
        if initial is not None:
            self.start(initial)

    def start(self, step: int) -> None:
        self.step = step
        if self.enabled and self.stream.isatty():
            self.bar = tqdm(
                total=self.total,
                initial=step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=self.stream,
            )
        self._start = self._last_line = time.monotonic()
        self._start_step = step
        self._last_bucket = self._bucket(step)

    def _bucket(self, step: int) -> int:
        return step * 100 // (self.total * PLAIN_PERCENT) if self.total else 0

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.bar is not None:
            self.bar.update(n)
            return
        bucket = self._bucket(self.step)
        if bucket != self._last_bucket or time.monotonic() - self._last_line >= PLAIN_MAX_GAP_S:
            self._last_bucket, self._due = bucket, True

    def set_postfix(self, **values: str) -> None:
        """Values shown after the count (bar), or in the next plain line; a plain line that is
        due goes out here, so that it carries the values of this step."""
        if self.bar is not None:
            self.bar.set_postfix(**values)
            return
        self._postfix = values
        if self._due or self.step == self.total:
            self._plain_line()

    def after_step(self, step: int) -> None:
        self.update(1)

    def logged(self, row: Row, *, steps: int) -> None:
        self.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self._due:
            self._plain_line()

    def _plain_line(self) -> None:
        self._due = False
        if not self.enabled:
            return
        now = time.monotonic()
        self._last_line = now
        elapsed = now - self._start
        done = self.step - self._start_step
        left = elapsed / done * (self.total - self.step) if done else 0.0
        extra = "".join(f", {k} {v}" for k, v in self._postfix.items())
        self.log.info(
            "train: %3d%% %d/%d steps%s, %s elapsed, %s left",
            self.step * 100 // max(self.total, 1),
            self.step,
            self.total,
            extra,
            timedelta(seconds=round(elapsed)),
            timedelta(seconds=round(left)),
        )
