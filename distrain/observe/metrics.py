"""Metrics sink: one JSON object per logged step in <run_dir>/metrics.jsonl, mirrored as
TensorBoard scalars under <run_dir>/tb/. Only rank 0 writes; other ranks hold a disabled sink."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, row: dict[str, Any]) -> None:
        """Append a row; it must carry `step`. Numeric fields also go to TensorBoard."""
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (for tests, benchmarks and tools)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
