"""benchmarks/gpu.sh --dry-run: the GPU check's steps on CPU, so the script cannot rot where CI
has no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_script_dry_run_trains_and_reports_mfu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT_DIR=str(tmp_path))
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "MFU" in done.stdout
    result = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert result["config"]["preset"] == "gpt2-tiny"
    (row,) = result["rows"]
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"]
