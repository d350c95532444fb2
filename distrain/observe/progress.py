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

PLAIN_PERCENT = 10
PLAIN_MAX_GAP_S = 300.0


class Progress:
    def __init__(
        self,
        *,
        total: int,
        initial: int,
        enabled: bool,
        logger: logging.Logger,
        stream: TextIO | None = None,
    ):
        stream = sys.stderr if stream is None else stream
        self.total, self.step, self.log = total, initial, logger
        self.enabled = enabled
        self.bar = None
        if enabled and stream.isatty():
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=stream,
            )
        self._start = self._last_line = time.monotonic()
        self._start_step = initial
        self._last_bucket = self._bucket(initial)
        self._postfix: dict[str, str] = {}
        self._due = False

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
