"""fp16 loss scaling under sharded layouts: one rank's overflow makes every rank (dp, tp and pp)
skip the same step and halve the same scale (distrain/parallel/scaler.py). The 8-rank run shares
the session's 8-rank torchrun launch (tests/batch.py's pool)."""

import math
import re

import pytest
from batch import Run, pool_name

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


def batched_runs(names: set[str]) -> dict[str, Run]:
    runs = {
        f"test_one_rank_overflow_skips_the_step_on_every_rank[{layout}]": run
        for layout, run in LAYOUTS.items()
    }
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
