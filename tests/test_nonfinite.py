"""Non-finite gradients (debug.nan_at_step): skipped on every rank and counted, or training stops
naming the step, the rank and the parameter; loss-spike flags."""

from __future__ import annotations

import json
import math

import pytest
from batch import Batches, Run
from helpers import train_in_process

from distrain.observe.health import LossSpikes, NonFiniteError
from distrain.observe.metrics import read_metrics

FIELDS = {
    "training__steps": 5,
    "training__global_batch_size": 4,
    "training__micro_batch_size": 2,
    "training__seq_len": 32,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


def test_skip_leaves_the_weights_finite_and_counts_the_step(tmp_path):
    rows = train_in_process(tmp_path / "run", **FIELDS, debug__nan_at_step=3)
    by_step = {r["step"]: r for r in rows if "loss" in r}
    assert [by_step[s]["nonfinite_skipped"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    # Had the NaN gradient reached the optimizer, every later loss would be NaN.
    assert all(math.isfinite(by_step[s]["loss"]) for s in range(1, 6))
    assert math.isnan(by_step[3]["grad_norm"])


def test_skip_also_skips_the_weight_update(tmp_path):
    """Up to the skipped step the run is the clean run; its step-4 loss then differs (step 3's
    update is missing) and stays finite."""
    clean = {
        r["step"]: r["loss"] for r in train_in_process(tmp_path / "a", **FIELDS) if "loss" in r
    }
    skipped = {
        r["step"]: r["loss"]
        for r in train_in_process(tmp_path / "b", **FIELDS, debug__nan_at_step=3)
        if "loss" in r
    }
    assert [skipped[s] for s in (1, 2, 3)] == [clean[s] for s in (1, 2, 3)]
    assert skipped[4] != clean[4]


def test_stop_names_step_rank_and_parameter(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_in_process(
            tmp_path / "run", **FIELDS, debug__nan_at_step=2, training__nonfinite="stop"
        )
    message = str(info.value)
    assert "non-finite gradient at step 2" in message
    assert "first on rank 0 in parameter tok_emb.weight" in message
    assert 'training.nonfinite = "stop"' in message


def test_skip_stops_after_max_nonfinite_steps_in_a_row(tmp_path):
    with pytest.raises(NonFiniteError, match=r"1 steps in a row \(training.max_nonfinite_steps"):
        train_in_process(
            tmp_path / "run", **FIELDS, debug__nan_at_step=2, training__max_nonfinite_steps=1
        )


def test_loss_spike_flags_a_loss_above_factor_times_the_running_mean():
    spikes = LossSpikes(2.0)
    assert [spikes.update(x) for x in (4.0, 4.2, 3.9, math.nan, 9.0, 4.0)] == [
        False,
        False,
        False,
        False,
        True,
        False,
    ]


@pytest.mark.slow
def test_ranks_agree_on_the_skip_and_stop_names_the_rank(tmp_path):
    # Rank 1's gradient turns NaN after DDP averaged them: both ranks must skip, or the
    # replicas diverge (debug.check_replicas compares them after every logged step). The same
    # run has rank 1 sleep 0.5 s per step: the straggler metrics must name it (shares the run
    # to keep multi-process tests few).
    # Both runs share one torchrun launch (tests/batch.py); the stopping run comes last, as its
    # failure ends the launch.
    runs = {
        "skip": Run(
            2,
            dict(
                FIELDS,
                debug__nan_at_step=2,
                debug__nan_rank=1,
                debug__check_replicas=True,
                debug__slow_rank=1,
                debug__slow_ms=500,
                watchdog__straggler_ratio=1.2,
            ),
        ),
        "stop": Run(
            2, dict(FIELDS, debug__nan_at_step=2, debug__nan_rank=1, training__nonfinite="stop")
        ),
    }
    batches = Batches(runs, tmp_path)
    skipped = batches.result("skip")
    assert skipped.error is None, skipped.error
    rows = [r for r in read_metrics(skipped.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 1, 1, 1]
    # Step 1 is left out: DDP rebuilds its buckets in the forward after the first backward (the
    # settling one distrain runs before step 1), a collective in which rank 0 waits for rank 1's
    # sleep (see distrain/observe/stragglers.py).
    timed = [r for r in rows if r["step"] != 1]
    assert [r["slowest_rank"] for r in timed] == [1] * 4
    # With 2 ranks the median is the mean, so the ratio is below 2; 0.5 s against a tiny
    # model's forward puts it well above 1.2.
    assert all(1.2 < r["straggler_ratio"] < 2 for r in timed), rows
    assert all(r["compute_s_max"] >= 0.5 for r in timed), rows
    assert "straggler: rank 1 computes " in (skipped.run_dir / "logs" / "rank0.log").read_text()

    stopped = batches.result("stop")
    assert stopped.error is not None and stopped.log is not None
    # Only a stopping run raises this error (the skipping run above finished).
    assert "first on rank 1 in parameter tok_emb.weight" in stopped.log.read_text(), stopped.error


def test_compute_timer_counts_data_and_forward_only():
    import time

    import torch

    from distrain.observe.stragglers import ComputeTimer, straggler_metrics

    timer = ComputeTimer(torch.device("cpu"))
    for phase, pause in (("data", 0.05), ("forward", 0.05), ("backward", 0.2), ("forward", 0.05)):
        timer.on_phase(phase)
        time.sleep(pause)
    timer.on_phase("optimizer")
    # 0.15 s counted (sleep overshoots by at most a few ms each), the 0.2 s of backward not.
    assert 0.15 <= timer.take() < 0.2
    assert timer.take() == 0.0
    assert straggler_metrics(0.3, torch.device("cpu")) == {
        "slowest_rank": 0,
        "straggler_ratio": 1.0,
        "compute_s_max": 0.3,
    }


def test_onebit_zero2_stop_names_the_parameter_its_averaged_gradient_holds():
    """ZeRO-2 1-bit Adam frees the local gradients once it reduce-scattered them in warm-up: the
    guard then reads the chunk of the averaged gradient each rank owns (the plan's
    `named_gradients`, what the trainer passes), so the stop names the parameter there, as in
    other layouts."""
    import torch

    from distrain.observe.health import NonFiniteGuard
    from distrain.optim.gradient_plan import OneBitZeroPlan
    from distrain.optim.onebit_zero import OneBitZeroAdam
    from distrain.optim.param_groups import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    optimizer = OneBitZeroAdam(
        param_groups(model, 0.1),
        lr=1e-2,
        betas=(0.9, 0.99),
        eps=1e-8,
        freeze_step=3,
        group=None,
        shard_gradients=True,
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].weight.grad[2, 5] = math.nan
    plan = OneBitZeroPlan([model], optimizer, holders=1)
    norm = plan.clip(1.0, counted_elsewhere=())  # the optimizer's reduce_and_clip
    assert all(p.grad is None for p in model.parameters())
    guard = NonFiniteGuard("stop", max_in_a_row=3, rank=0, world_size=1)
    with pytest.raises(NonFiniteError) as info:
        guard.step_ok(norm, step=2, named_params=plan.named_gradients(), agreed=True)
    assert "non-finite gradient at step 2" in str(info.value)
    assert "first on rank 0 in parameter 1.weight" in str(info.value)
    # Outside that window (no chunk held) the parameters themselves are read.
    optimizer.zero_grad()
    assert [n for n, _ in plan.named_gradients()] == [n for n, _ in model.named_parameters()]
    assert all(isinstance(p, torch.nn.Parameter) for _, p in plan.named_gradients())


def test_local_gradients_skip_on_every_rank_and_name_the_rank(tmp_path, monkeypatch):
    """NonFiniteGuard on 2 ranks whose gradients stay local (agreed=False), only rank 1's norm
    NaN at step 2; each rank's all-reduce (one per step) is played in process: the sum of its
    own flags and the other rank's."""
    import torch
    import torch.distributed as dist

    from distrain.observe.diagnose import diagnose
    from distrain.observe.health import NonFiniteGuard
    from distrain.observe.logs import close_logging, setup_logging

    norms = {1: [1.0, 1.0], 2: [2.0, math.nan], 3: [3.0, 3.0]}
    reduces = []
    for rank in (0, 1):
        other = 1 - rank
        logger = setup_logging(tmp_path, rank)
        try:
            logger.info("rank %d/2 on cpu (gloo)", rank)
            guard = NonFiniteGuard("skip", max_in_a_row=3, rank=rank, world_size=2)
            updates = []
            for step, norm in norms.items():
                others = torch.zeros(2, dtype=torch.int32)
                others[other] = int(math.isnan(norm[other]))

                def all_reduce(tensor, others=others):
                    reduces.append(tensor.clone())
                    tensor.add_(others)  # ReduceOp.SUM, the default

                monkeypatch.setattr(dist, "all_reduce", all_reduce)
                norm_here = torch.tensor(norm[rank])
                updates.append(guard.step_ok(norm_here, step=step, named_params=[], agreed=False))
        finally:
            close_logging(logger)
        # Both ranks skip step 2 (else the replicas diverge), though only rank 1's norm was NaN.
        assert updates == [True, False, True]
    # One collective per step, each rank filling its own slot only.
    assert len(reduces) == 6
    assert [t.tolist() for t in reduces] == [[0, 0], [0, 0], [0, 0], [0, 0], [0, 1], [0, 0]]
    rows = [{"step": s, "loss": 1.0, "nonfinite_skipped": int(s >= 2)} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    assert "non-finite gradients: update skipped at step(s) 2 (rank(s) 1)" in diagnose(tmp_path)
    # Logged every 3 steps: the row of step 3 counts the skip, the logs date it.
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    assert "non-finite gradients: update skipped at step(s) 2 (rank(s) 1)" in diagnose(tmp_path)
