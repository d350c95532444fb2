"""`distrain plan --calibrate`: this machine's measured matmul rate, collective costs (the
alpha-beta fit of collectives.py, under "collectives") and concurrency (how far a collective
progresses while the rank computes, collectives.py's `time_concurrency`), stored under the user's
cache directory ($XDG_CACHE_HOME/distrain/calibration.json, default ~/.cache) for later plans.
A plan given no --peak is for devices like this machine's: its peak is the measured rate with
efficiency 1 (the rate is already achieved) and its concurrency the measured one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from distrain.plan.collectives import LinkCost, measure_collectives


def cache_dir() -> Path:
    """Where the planner keeps what it measured: $XDG_CACHE_HOME/distrain (default ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "distrain"


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def matmul_flops(size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of a square matmul on this device over `repeats` timed runs."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: thread pool and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def calibrate(*, collectives: bool = True, repeats: int = 10) -> dict[str, Any]:
    """Measure and store; `collectives=False` keeps the matmul rate only (no processes started);
    `repeats`: timed runs of each collective at each size."""
    found: dict[str, Any] = {"peak_flops": matmul_flops(), "threads": torch.get_num_threads()}
    if collectives:
        measured = measure_collectives(repeats=repeats)
        found["collectives"] = {kind: cost.as_dict() for kind, cost in measured.costs.items()}
        found["concurrency"] = measured.concurrency
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found))
    return found


def load_calibration() -> dict[str, Any] | None:
    path = calibration_path()
    return json.loads(path.read_text()) if path.exists() else None


def collective_costs(calibration: dict[str, Any] | None) -> dict[str, LinkCost] | None:
    """The stored alpha-beta costs, or None when the calibration predates them."""
    if not calibration or "collectives" not in calibration:
        return None
    return {kind: LinkCost(**c) for kind, c in calibration["collectives"].items()}
