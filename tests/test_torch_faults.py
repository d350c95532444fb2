"""What torch 2.13 itself gets wrong, behind the layout rules (distrain/layout/rules.py) that
refuse it.

Each test runs plain torch, no distrain code, and passes while torch is still wrong: when a torch
upgrade fixes the fault, the test fails and names the rule to lift.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A 2-rank DDP step on gloo, nothing else.
DDP_STEP = """
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_on_gloo_still_crashes_under_detail_debug(tmp_path: Path):
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_STEP)
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL", OMP_NUM_THREADS="1")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*run, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode != 0 and "SIGSEGV" in result.stderr, (
        "torch no longer crashes DDP on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL: lift the "
        "layout rule ddp_detail_debug_on_gloo (distrain/layout/rules.py)\n" + result.stderr[-3000:]
    )
