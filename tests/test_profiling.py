"""Profiler traces: Chrome-trace JSON per profiled rank with the named phase ranges."""

from __future__ import annotations

import json

import pytest
from helpers import train_in_process

from distrain.errors import ConfigError
from distrain.observe.profiling import profiled_ranks


def test_trace_parses_and_holds_the_phase_ranges(tmp_path):
    run = tmp_path / "run"
    train_in_process(
        run,
        training__steps=4,
        training__global_batch_size=4,
        training__micro_batch_size=2,
        training__seq_len=32,
        checkpoint__interval_steps=0,
        checkpoint__at_end=False,
        profile__start_step=2,
        profile__num_steps=2,
    )
    trace = json.loads((run / "profiles" / "rank0" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in ("data", "forward", "backward", "optimizer", "log"):
        assert f"distrain/{phase}" in names, phase
    # Two profiled steps, two micro-batches each: four forward ranges on the host (on CUDA each
    # also has its span on the GPU's timeline, category gpu_user_annotation).
    forward = [e for e in trace["traceEvents"] if e.get("name") == "distrain/forward"]
    assert sum(e.get("cat") == "user_annotation" for e in forward) == 4
    assert "profile of 2 step(s) written to" in (run / "logs" / "rank0.log").read_text()


def test_profiled_ranks():
    assert profiled_ranks("all", 3) == {0, 1, 2}
    assert profiled_ranks("0,2", 3) == {0, 2}
    with pytest.raises(ConfigError, match="profile.ranks"):
        profiled_ranks("0,5", 3)
    with pytest.raises(ConfigError, match="profile.ranks"):
        profiled_ranks("first", 3)
