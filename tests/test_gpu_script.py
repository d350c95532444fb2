"""benchmarks/gpu.sh --dry-run: the GPU acceptance run's stages on CPU with tiny sizes, so the
script cannot rot where CI has no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("cuda_tests", "throughput", "checkpoint", "planner_memory", "trace")


@pytest.mark.slow
def test_gpu_dry_run_records_every_stage(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT_DIR=str(tmp_path))
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    record = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    stages = record["stages"]
    assert done.returncode == 0, json.dumps(stages)[-3000:] + done.stdout[-2000:]
    assert not (tmp_path / "gpu-acceptance.json").exists()  # the real record is the GPU's
    assert tuple(stages) == STAGES and record["failed"] == []
    assert record["device"] == "CPU" and record["torch"] and "date" in record
    assert any("compil" in note for note in record["notes"])
    # CUDA-only: the marked tests were collected by marker and skipped here.
    assert stages["cuda_tests"]["status"] == "skipped: no CUDA"
    marked = stages["cuda_tests"]["result"]["requires_cuda"]
    assert marked["tests"] >= 2 and marked["skipped"] == marked["tests"]
    for name in STAGES[1:]:
        assert stages[name]["status"] == "ok", (name, stages[name])
    throughput = stages["throughput"]["result"]
    assert set(throughput) == {"llama-tiny", "qwen3-tiny"}
    for part in throughput.values():
        rows = part["rows"]
        assert [r["activation_checkpointing"] for r in rows] == ["none", "full"]
        assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows)
    ckpt = stages["checkpoint"]["result"]
    assert ckpt["sync_stall_s"] > 0 and ckpt["async_stall_s"] > 0
    planner = stages["planner_memory"]["result"]
    assert len(planner["rows"]) == 4 and all(r["modelled_peak"] > 0 for r in planner["rows"])
    assert planner["measured"].startswith("skipped: no CUDA")
    trace = stages["trace"]["result"]
    assert {"distrain/forward", "distrain/backward"} <= set(trace["host_ranges"])
    assert trace["gpu_ranges"] == "skipped: no CUDA"
