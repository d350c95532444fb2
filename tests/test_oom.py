"""Out-of-memory recovery: an injected OOM on one rank makes every rank halve the micro-batch
and retry the step; the global batch, and so the loss curve, is unchanged. The multi-process
runs share the session's torchrun launch of their world size (tests/batch.py's pool)."""

from pathlib import Path

import pytest
import torch
from batch import Run, pool_name
from helpers import losses, train_in_process
from test_parity import BASE as PARITY
from test_parity import EP_ROUTES, assert_parity

from distrain.observe.metrics import read_metrics
from distrain.train.oom import split

BASE = {
    "training__steps": 6,
    "training__global_batch_size": 16,
    "training__seq_len": 64,
    "training__oom_recovery": True,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


def test_split_keeps_samples_and_order():
    batches = [(torch.arange(8).view(4, 2), torch.arange(8).view(4, 2) + 1) for _ in range(2)]
    halves = split(batches, 2)
    assert len(halves) == 4 and all(len(b[0]) == 2 for b in halves)
    assert torch.equal(torch.cat([b[0] for b in halves]), torch.cat([b[0] for b in batches]))


ONE_RANK_OOM = "test_injected_oom_on_one_rank_halves_micro_batch_everywhere"


@pytest.mark.slow
def test_injected_oom_on_one_rank_halves_micro_batch_everywhere(batched):
    small, oom = batched(f"{ONE_RANK_OOM}:small"), batched(f"{ONE_RANK_OOM}:oom")
    for rank in range(2):
        log = (oom / "logs" / f"rank{rank}.log").read_text()
        assert "step 3 ran out of memory on some rank: retrying with micro-batch 2" in log, rank
    rows = read_metrics(oom / "metrics.jsonl")
    assert {"step": 3, "oom_retry_micro_batch_size": 2} in rows
    got, want = losses(rows), losses(read_metrics(small / "metrics.jsonl"))
    # 1e-6: the first two steps ran with micro-batch 4, the reference with 2; accumulating
    # 2 x 4 or 4 x 2 sequences reorders fp32 sums (~1e-7), nothing else differs.
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6 * want[step], (step, got[step], want[step])


@pytest.mark.slow
def test_oom_at_micro_batch_one_is_a_clear_error(batch_pool):
    outcome = batch_pool.result(pool_name(__name__, "test_oom_at_micro_batch_one_is_a_clear_error"))
    assert outcome.error is not None and outcome.log is not None
    assert "step 2 runs out of memory even with training.micro_batch_size = 1" in (
        outcome.log.read_text()
    )


# FSDP2 with tp, pp with FSDP2, and cp (DDP over dp x cp): a rank's forward runs collectives,
# so the ranks agree before each micro-batch (before the schedule under pp) and retry together
# (distrain/train/oom.py).
# Each recovered run must still give the 1-process loss curve of test_parity (same batch, seed
# and tolerance): kept gradients of the abandoned attempt, or a micro-batch counted twice, move
# the loss by 1e-3 or more.
SHARDED = {
    "zero3x2_tp2": {"parallel__zero_stage": 3, "parallel__tp": 2},
    "pp2_zero2x2": {"parallel__pp": 2, "parallel__zero_stage": 2},
    "cp2_dp2": {"parallel__cp": 2},
}


# Expert parallelism: every forward's all-to-alls pair up the ranks, so they agree before
# each micro-batch as under FSDP2 (ep runs on it), and a retry must not keep an expert's
# gradient of the abandoned attempt. Dropless top-2 without a balancing term, so that the
# 1-process curve does not depend on the micro-batch size the retry halves (capacity and the
# balancing losses are counted per micro-batch).
EP_MODEL = dict(EP_ROUTES["top2_dropless"], model__moe__balance="none")
EP_OOM = "test_injected_oom_under_expert_parallel_keeps_the_loss_curve"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    return losses(train_in_process(run, **dict(PARITY, training__micro_batch_size=8)))


def batched_runs(names: set[str]) -> dict[str, Run]:
    """Every multi-process run of this file that the selected cases `names` need (tests/batch.py's
    pool; the run that fails on purpose goes last of its world size, so its launch ends after
    it)."""
    runs = {
        f"{ONE_RANK_OOM}:small": Run(2, dict(BASE, training__micro_batch_size=2)),
        f"{ONE_RANK_OOM}:oom": Run(
            2,
            dict(BASE, training__micro_batch_size=4, debug__oom_at_step=3, debug__oom_rank=1),
        ),
        "test_oom_at_micro_batch_one_is_a_clear_error": Run(
            2,
            dict(
                BASE,
                training__global_batch_size=2,
                training__micro_batch_size=1,
                debug__oom_at_step=2,
            ),
            fails=True,
        ),
    }
    for name, layout in SHARDED.items():
        fields = dict(PARITY, **layout, training__oom_recovery=True, debug__oom_at_step=3)
        runs[f"test_injected_oom_under_sharded_layouts_keeps_the_loss_curve[{name}]"] = Run(
            4, dict(fields, debug__oom_rank=3)
        )
    runs[EP_OOM] = Run(
        2,
        dict(
            PARITY,
            **EP_MODEL,
            parallel__ep=2,
            training__oom_recovery=True,
            debug__oom_at_step=3,
            debug__oom_rank=1,
        ),
    )
    return {name: run for name, run in runs.items() if name.split(":")[0] in names}


@pytest.fixture(scope="module")
def batched(batch_pool):
    """The run dir of a run that trained without error."""

    def run_dir(name: str) -> Path:
        return batch_pool.trained(pool_name(__name__, name))

    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", SHARDED.values(), ids=SHARDED.keys())
def test_injected_oom_under_sharded_layouts_keeps_the_loss_curve(
    layout, reference, batched, request
):
    run = batched(request.node.name)
    for rank in range(4):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert "step 3 ran out of memory on some rank: retrying with micro-batch 1" in log, rank
    rows = read_metrics(run / "metrics.jsonl")
    assert {"step": 3, "oom_retry_micro_batch_size": 1} in rows
    assert_parity(losses(rows), reference)


@pytest.mark.slow
def test_injected_oom_under_expert_parallel_keeps_the_loss_curve(batched, tmp_path):
    run = batched(EP_OOM)
    for rank in range(2):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert "step 3 ran out of memory on some rank: retrying with micro-batch 1" in log, rank
    rows = read_metrics(run / "metrics.jsonl")
    assert {"step": 3, "oom_retry_micro_batch_size": 1} in rows
    assert all(row["comm_bytes"] > 0 for row in rows if "loss" in row)  # rows were exchanged
    want = losses(train_in_process(tmp_path / "ref", **PARITY, **EP_MODEL))
    assert_parity(losses(rows), want)
