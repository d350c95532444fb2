"""Metrics sink: one JSON object per logged step in <run_dir>/metrics.jsonl, mirrored as
TensorBoard scalars under <run_dir>/tb/. Only rank 0 writes; other ranks hold a disabled sink.

A run that is started again (a restart, `--resume`) appends to the same file and redoes the
steps since its checkpoint, so the rows of a later attempt carry its number (`"attempt": k`, k >= 1;
no field means the first attempt) and begin with a `{"step": S, "resumed_from": S, "attempt": k}`
row. `read_metrics` uses
those to give one curve: the rows of earlier attempts past S are dropped (`all_attempts=True`
keeps them).

A `RowSink` (the experiment trackers, observe/trackers.py) gets every row written, and is
closed with the writer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any, Protocol

from distrain.files import open_append
from distrain.observe.observer import Row, StepObserver

NOT_SCALARS = ("step", "attempt")


class RowSink(Protocol):
    def log_row(self, row: Row) -> None: ...

    def close(self) -> None: ...


class MetricsWriter(StepObserver):
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        sink: RowSink | None = None,
        new_attempt: bool = True,
    ):
        """`new_attempt=False` appends rows to the last attempt (an evaluation after training)."""
        self.enabled = enabled
        self.attempt = 0
        self.sink = sink
        self._file = None
        self._tb = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        # Opened (a planted symlink refused) before anything is read or cut.
        self._file = open_append(path)
        _drop_torn_last_line(path, self._file)
        last = max((r.get("attempt", 0) for r in read_metrics(path, all_attempts=True)), default=-1)
        self.attempt = last + 1 if new_attempt else max(last, 0)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def start(self, step: int) -> None:
        """Mark where this attempt begins (called once training is about to start at `step`)."""
        if self.attempt > 0:
            self.log({"step": step, "resumed_from": step})

    def log(self, row: dict[str, Any]) -> None:
        """Append a row; it must carry `step`. Numeric fields also go to TensorBoard."""
        if not self.enabled:
            return
        if self.attempt:
            row = {**row, "attempt": self.attempt}
        self._file.write(json.dumps(row) + "\n")
        if self.sink is not None:
            self.sink.log_row(row)
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key not in NOT_SCALARS and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)

    def logged(self, row: Row, *, steps: int) -> None:
        self.log(row)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _drop_torn_last_line(path: Path, file: IO[str]) -> None:
    """Cut a last line without its newline (its writer was killed mid-write), through `file`
    (`path` opened to append), so that the rows appended next start on a line of their own."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        os.ftruncate(file.fileno(), data.rfind(b"\n") + 1)


def read_metrics(path: Path, *, all_attempts: bool = False) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (for tests, benchmarks and tools): one curve, where a
    later attempt replaces the steps an earlier one logged after its resume point. A last line
    cut short by a killed writer is skipped."""
    lines = Path(path).read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    if all_attempts:
        return rows
    curve: list[dict[str, Any]] = []
    for row in rows:
        if "resumed_from" in row:
            curve = [r for r in curve if r["step"] <= row["resumed_from"]]
        curve.append(row)
    return curve
