"""A checkpoint's non-tensor entries (DCP byte entries: torch.save pickles inside the shard files)
are read with `torch.load(weights_only=True)`: a checkpoint whose entry unpickles to a shell
command, with a manifest whose hashes match (whoever can write the folder can write both), runs
nothing and fails to load in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distrain.checkpoint.load import load
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_byte_entry_that_runs_a_command_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "step-00000001"
    dcp.save({"w": torch.ones(4), "extra": _Payload(marker)}, checkpoint_id=str(folder))
    with pytest.raises(CheckpointError, match="UnpicklingError: Weights only load failed"):
        load(Storage(str(tmp_path)), str(folder), {"w": torch.zeros(4), "extra": {}})
    assert not marker.exists()
    # torch's own planner loads byte entries with weights_only=False: the attack is real.
    dcp.load({"w": torch.zeros(4), "extra": {}}, checkpoint_id=str(folder))
    assert marker.exists()
