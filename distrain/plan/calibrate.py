"""`distrain plan --calibrate`: this machine's measured matmul rate, collective costs (the
alpha-beta fit of collectives.py, under "collectives") and concurrency (how far a collective
progresses while the rank computes, collectives.py's `time_concurrency`), stored under the user's
cache directory ($XDG_CACHE_HOME/distrain/calibration.json, default ~/.cache) for later plans.
A plan given no --peak is for devices like this machine's: its peak is the measured rate with
efficiency 1 (the rate is already achieved) and its concurrency the measured one.

The stored file is data another process could have written: a plan reads it only as a regular
file (not a link) of at most MAX_STORED_BYTES of JSON holding what `calibrate` writes, each
figure a finite number in its range, and refuses anything else with the fix (calibrate again)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from distrain.errors import ConfigError
from distrain.plan.build_store import read_stored_json
from distrain.plan.collectives import KINDS, LinkCost, measure_collectives

MAX_STORED_BYTES = 64 * 2**10
"""What `calibrate` writes is under 1 KiB."""


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
    """What `calibrate` stored (None when nothing is), checked (the module docstring)."""
    path = calibration_path()
    fix = f"calibration file {path}: {{}}; run `distrain plan --calibrate` again or delete it"
    try:
        data = read_stored_json(path, MAX_STORED_BYTES)
        _check(data)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link (ELOOP), or not readable
        raise ConfigError(fix.format(f"not a readable regular file ({e.strerror})")) from None
    except ValueError as e:
        raise ConfigError(fix.format(e)) from None
    return data  # type: ignore[return-value]


def _number(
    value: Any, name: str, low: float, high: float = math.inf, *, integer: bool = False
) -> None:
    what = "integer" if integer else "number"
    if type(value) not in ((int,) if integer else (int, float)) or not (
        math.isfinite(value) and low <= value <= high
    ):
        raise ValueError(f"{name} ({value!r}) is not a finite {what} from {low} to {high}")


def _check(data: Any) -> None:
    """ValueError unless `data` is what `calibrate` writes."""
    if not isinstance(data, dict) or not set(data) <= {
        "peak_flops",
        "threads",
        "collectives",
        "concurrency",
    }:
        raise ValueError("not a calibration")
    _number(data.get("peak_flops"), "peak_flops", 1.0)
    if "threads" in data:
        _number(data["threads"], "threads", 1, integer=True)
    if "concurrency" in data:
        _number(data["concurrency"], "concurrency", 0.0, 1.0)
    costs = data.get("collectives", {})
    if not isinstance(costs, dict) or not set(costs) <= set(KINDS):
        raise ValueError(f"collectives are not a table of {', '.join(KINDS)}")
    for kind, cost in costs.items():
        if not isinstance(cost, dict) or set(cost) != {"latency_s", "s_per_byte", "group_size"}:
            raise ValueError(f"{kind} is not a latency, a cost per byte and a group size")
        _number(cost["latency_s"], f"{kind} latency_s", 0.0)
        _number(cost["s_per_byte"], f"{kind} s_per_byte", 0.0)
        _number(cost["group_size"], f"{kind} group_size", 1, integer=True)


def collective_costs(calibration: dict[str, Any] | None) -> dict[str, LinkCost] | None:
    """The stored alpha-beta costs, or None when the calibration predates them."""
    if not calibration or "collectives" not in calibration:
        return None
    return {kind: LinkCost(**c) for kind, c in calibration["collectives"].items()}
