"""Resume equals the uninterrupted run bit for bit (fp32, CPU), where a+b+c order matters:

- 4 ranks, a worker killed with SIGKILL from outside and, in the restarted job, another by
  debug injection, each restarted by torchrun's agent: every step's loss after the restarts,
  and every weight and optimizer value at the end, == the uninterrupted 4-rank run's. DDP's
  buckets are settled before the first step (distrain/parallel/data_parallel.py), so the restarted
  processes reduce in the same order as the processes they replace. (Losses alone are too
  coarse: the few gradient elements one ulp apart when the order differs rarely move a loss by
  an ulp within a few steps; the weights show it.)
- 1-bit Adam on 2 ranks, resumed once in its warm-up (a crash, then `--resume`) and once past its
  freeze step (a SIGKILL restarted by the agent): its phase, moments and error buffers come back
  from the checkpoint, so every loss == the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from batch import Batches, Run, pool_name
from helpers import SMALL_RUN, losses, overrides, run_cli, start_train, worker_pid
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distrain.observe.metrics import read_metrics

STEPS = 10
# Checkpoints at steps 2, 4, ...: a failure after step k resumes from the last even step <= k.
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 2,
    "checkpoint__at_end": True,
    # Several DDP buckets, as any model past 25 MB has: the 3.3 MB model would fit one bucket
    # under the default cap, and then both layouts happen to sum alike.
    "comm__bucket_cap_mb": 0.5,
}


def run_losses(run_dir: Path) -> dict[int, float]:
    return losses(read_metrics(run_dir / "metrics.jsonl"))


def logged_steps(run_dir: Path) -> list[int]:
    """Every logged training step of every attempt, re-run steps included."""
    rows = read_metrics(run_dir / "metrics.jsonl", all_attempts=True)
    return [r["step"] for r in rows if "loss" in r]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor of the run's last checkpoint, by its name."""
    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{STEPS:08d}", out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    saved = torch.load(out, weights_only=False)
    walk("model", saved["model"])
    walk("optim", saved["optim"])
    return flat


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and any(".exp_avg_sq" in k for k in want)
    differing = {
        k: int((got[k] != want[k]).sum()) for k in want if not torch.equal(got[k], want[k])
    }
    assert not differing, differing


def _kill_when_logged(agent, run_dir: Path, *, rank: int, after_step: int) -> None:
    """SIGKILL rank `rank`'s worker from outside once step `after_step` has been logged."""
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and agent.poll() is None:
        if metrics.exists() and max(logged_steps(run_dir), default=0) >= after_step:
            pid = worker_pid(agent.pid, rank)
            assert pid is not None, "worker not found"
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError(f"step {after_step} was never logged (agent exit {agent.poll()})")


REFERENCE = "four_rank_reference"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The uninterrupted 4-rank run, where a selected test compares with it (tests/batch.py's
    pool: it shares the session's 4-rank torchrun launch)."""
    users = {
        "test_four_ranks_sigkill_from_outside_resumes_bit_exact",
        "test_four_ranks_injected_kill_resumes_bit_exact",
    }
    return {REFERENCE: Run(4, FIELDS)} if users & names else {}


@pytest.fixture(scope="module")
def four_rank_reference(batch_pool) -> Path:
    return batch_pool.trained(pool_name(__name__, REFERENCE))


def steps_by_attempt(run_dir: Path) -> list[tuple[int, list[int]]]:
    """Per attempt: the step it resumed from (0 for the first) and the training steps it
    logged."""
    attempts: dict[int, tuple[int, list[int]]] = {}
    for row in read_metrics(run_dir / "metrics.jsonl", all_attempts=True):
        start = row.get("resumed_from", 0)
        _, steps = attempts.setdefault(row.get("attempt", 0), (start, []))
        if "loss" in row:
            steps.append(row["step"])
    return [attempts[k] for k in sorted(attempts)]


# Rank 3 kills itself as step 8 begins, in the job's second attempt only.
INJECTED = {
    "debug__fail_at_step": 8,
    "debug__fail_rank": 3,
    "debug__fail_mode": "kill",
    "debug__fail_attempt": 1,
}


@pytest.fixture(scope="module")
def restarted_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One 4-rank job that torchrun's agent restarts twice: rank 2's worker SIGKILLed from
    outside once step 3 is logged (attempt 0), then rank 3 killed by debug injection as step 8
    begins (attempt 1); attempt 2 finishes. (run dir, exit code, stderr), for both tests below:
    one launch of 4 ranks with its restarts instead of two."""
    run = tmp_path_factory.mktemp("restarts") / "run"
    agent = start_train(run, "--nproc", "4", "--max-restarts", "2", **FIELDS, **INJECTED)
    try:
        _kill_when_logged(agent, run, rank=2, after_step=3)
        _, stderr = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    return run, agent.returncode, stderr


@pytest.mark.slow
def test_four_ranks_sigkill_from_outside_resumes_bit_exact(restarted_twice, four_rank_reference):
    run, code, stderr = restarted_twice
    assert code == 0, stderr[-4000:]
    # The second attempt resumed from a checkpoint and re-ran the steps after it.
    assert "resumed from checkpoint step-" in (run / "logs" / "rank2.log").read_text()
    (_, first), (resumed, _) = steps_by_attempt(run)[:2]
    assert first[-1] >= 3 and 0 < resumed < first[-1], steps_by_attempt(run)
    assert logged_steps(run)[-1] == STEPS
    assert run_losses(run) == run_losses(four_rank_reference)
    assert_same_state(final_state(run), final_state(four_rank_reference))


@pytest.mark.slow
def test_four_ranks_injected_kill_resumes_bit_exact(restarted_twice, four_rank_reference):
    run, code, stderr = restarted_twice
    assert code == 0, stderr[-4000:]
    assert "rank 3 crashes at step 8 (kill)" in (run / "logs" / "rank3.log").read_text()
    # The injected kill ended attempt 1 as step 8 began; attempt 2 resumed from step 6's
    # checkpoint.
    attempts = steps_by_attempt(run)
    assert len(attempts) == 3 and attempts[1][1][-1] == 7, attempts
    assert attempts[2] == (6, [7, 8, 9, 10]), attempts
    assert run_losses(run) == run_losses(four_rank_reference)
    assert_same_state(final_state(run), final_state(four_rank_reference))


ONEBIT_FIELDS = {
    **FIELDS,
    "training__micro_batch_size": 4,
    "optim__name": "onebit_adam",
    "optim__onebit__freeze_step": 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1], ids=["ddp", "zero1"])
def test_onebit_adam_resumes_bit_exact_in_both_phases(zero_stage, tmp_path, check_ok):
    # zero_stage 1: OneBitZeroAdam, whose moments and server errors are gathered from their
    # owners into each parameter's entries.
    onebit = {**ONEBIT_FIELDS, "parallel__zero_stage": zero_stage}
    # The uninterrupted run and the one stopped in warm-up share a torchrun launch
    # (tests/batch.py); the stop ends it, so it comes last.
    batches = Batches(
        {"ref": Run(2, onebit), "run": Run(2, dict(onebit, debug__fail_at_step=3))}, tmp_path
    )
    ref = batches.result("ref")
    assert ref.error is None, ref.error
    reference = run_losses(ref.run_dir)
    # In warm-up: the job stops at step 3 and is started again with --resume (from step 2).
    stopped = batches.result("run")
    assert stopped.error is not None and "crashes at step 3" in stopped.error, stopped.error
    run = stopped.run_dir
    # Past the freeze step: rank 1 is SIGKILLed as step 8 begins and restarted from step 6's
    # checkpoint (after two compressed steps: non-zero error buffers).
    args = ["train", "--nproc", "2", "--max-restarts", "1", "--resume"]
    faults = {"debug__fail_at_step": 8, "debug__fail_rank": 1, "debug__fail_mode": "kill"}
    for key, value in overrides(run, **onebit, **faults):
        args += [f"--{key}", value]
    check_ok(run_cli(*args, timeout=300))
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10]
    assert run_losses(run) == reference
    assert_same_state(final_state(run), final_state(ref.run_dir))
