"""fp16 loss scaling under sharded layouts: one rank's overflow makes every rank (dp, tp, pp
and cp) skip the same step and halve the same scale (distrain/parallel/scaler.py). The runs
share the session's torchrun launches of their world size (tests/batch.py's pool)."""

import math
import re

import pytest
from batch import Run, pool_name
from helpers import losses, train_in_process
from test_parity import BASE as PARITY
from test_parity import assert_parity

from distrain.observe.metrics import read_metrics

# pp2 x dp_shard2 (ZeRO-2) x tp2: each rank holds a different shard of a different stage, so
# only an agreed flag makes rank 0 see the NaN that rank 7's shard holds.
FIELDS = {
    "training__steps": 4,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": 32,
    "training__precision": "fp16",
    "parallel__pp": 2,
    "parallel__tp": 2,
    "parallel__sequence_parallel": False,
    "parallel__zero_stage": 2,
    "debug__nan_at_step": 3,
    "debug__nan_rank": 7,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
SKIP = re.compile(
    r"step (\d+): fp16 gradients overflowed on some rank: .* loss scale (\S+) -> (\S+)"
)


# Expert parallelism: each rank holds other experts (ep2, a DTensor on the expert mesh, not
# the dense FSDP2 mesh) and its half of the routed rows came over an fp16 all-to-all; the NaN
# on rank 1 must still make rank 0 skip.
EP_FIELDS = dict(
    FIELDS,
    parallel__pp=1,
    parallel__tp=1,
    parallel__zero_stage=3,
    parallel__ep=2,
    model__moe__num_experts=4,
    model__moe__every=2,
    debug__nan_rank=1,
)

LAYOUTS = {"pp2_zero2_tp2": Run(8, FIELDS), "ep2_zero3": Run(2, EP_FIELDS)}


CP_OVERFLOW = "test_cp_fp16_matches_one_process_and_skips_an_overflow_together"
# fp16 with the parity matrix's batch of sequences of 32 tokens, 4 steps; a NaN in one gradient at
# step 3 (the 1-process reference gets it on its only rank, the cp2 run on rank 1 alone, after
# DDP's all-reduce). fp16 on a CPU is slow (no native fp16 matmul): the runs are kept short.
CP_FP16 = dict(
    PARITY,
    training__steps=4,
    training__seq_len=32,
    training__precision="fp16",
    debug__nan_at_step=3,
)


def batched_runs(names: set[str]) -> dict[str, Run]:
    runs = {
        f"test_one_rank_overflow_skips_the_step_on_every_rank[{layout}]": run
        for layout, run in LAYOUTS.items()
    }
    runs[CP_OVERFLOW] = Run(2, dict(CP_FP16, parallel__cp=2, debug__nan_rank=1))
    return {name: run for name, run in runs.items() if name in names}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_rank_overflow_skips_the_step_on_every_rank(layout, batch_pool, request):
    run = batch_pool.trained(pool_name(__name__, request.node.name))
    for rank in range(LAYOUTS[layout].nproc):
        skips = SKIP.findall((run / "logs" / f"rank{rank}.log").read_text())
        assert skips == [("3", "65536", "32768")], (rank, skips)
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert [(rows[s]["loss_scale"], rows[s]["fp16_skipped"]) for s in (1, 2, 3, 4)] == [
        (65536.0, 0),
        (65536.0, 0),
        (32768.0, 1),
        (32768.0, 1),
    ]
    assert all(math.isfinite(rows[s]["loss"]) for s in rows)
    assert not math.isfinite(rows[3]["grad_norm"]) and math.isfinite(rows[4]["grad_norm"])


# cp2 fp16 against the 1-process fp16 run: the cp ranks' blockwise attention upcasts to fp32 and
# merges its blocks, where one process runs fp16 attention over the whole sequence, so the two
# round differently. Measured worst 5.0e-6 relative over the 4 steps; 3e-5 leaves 6x room and
# still fails a real bug (1e-3 or more: tests/test_parity.py's docstring; a rank that updated
# at step 3 alone moves step 4's loss by about a step's decrease, 1e-2).
CP_FP16_REL_TOL = 3e-5


@pytest.mark.slow
def test_cp_fp16_matches_one_process_and_skips_an_overflow_together(batch_pool, tmp_path):
    """Rank 1's NaN is in its gradients only: unless the found-inf flag is agreed over the cp
    ranks, rank 0 updates at step 3 while rank 1 skips, and the curve leaves the reference's."""
    run = batch_pool.trained(pool_name(__name__, CP_OVERFLOW))
    for rank in range(2):
        skips = SKIP.findall((run / "logs" / f"rank{rank}.log").read_text())
        assert skips == [("3", "65536", "32768")], (rank, skips)
    reference = train_in_process(tmp_path / "ref", **dict(CP_FP16, training__micro_batch_size=8))
    assert [r["fp16_skipped"] for r in reference if "loss" in r] == [0, 0, 1, 1]
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), losses(reference), CP_FP16_REL_TOL)
