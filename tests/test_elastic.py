"""Elastic launch: a killed rank restarted by torchrun's agent, a resume on fewer ranks, and two
agents rendezvousing as two nodes. Each run goes through `distrain train`, as a user starts it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from batch import Run, pool_name
from helpers import (
    SMALL_RUN,
    cli_in_process,
    free_port,
    losses,
    overrides,
    run_cli,
    start_train,
    train_cli,
    train_in_process,
)

from distrain.observe.metrics import read_metrics

STEPS = 6
# Global batch 8 in micro-batches of 2: 4 ranks need no accumulation, 2 ranks accumulate 2, so the
# same run continues on either. Checkpoints at steps 2 and 4; a crash at step 4 resumes at 2.
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 2,
    "checkpoint__at_end": False,
}


def assert_rel_close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got[step], want[step])


def run_losses(run_dir: Path) -> dict[int, float]:
    return losses(read_metrics(run_dir / "metrics.jsonl"))


def logged_steps(run_dir: Path, *, all_attempts: bool = False) -> list[int]:
    rows = read_metrics(run_dir / "metrics.jsonl", all_attempts=all_attempts)
    return [r["step"] for r in rows if "loss" in r]


REFERENCE = "two_rank_reference"
HALF = "test_resume_on_half_the_ranks_continues_the_run"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The uninterrupted 2-rank run, where a selected test compares with it, and the 4-rank run
    that crashes at step 4, to be resumed on 2 ranks (tests/batch.py's pool: they share the
    session's 2- and 4-rank torchrun launches; the crash ends its launch, so it comes last)."""
    users = {
        "test_killed_rank_is_restarted_and_resumes_bit_exact",
        "test_two_agents_rendezvous_as_two_nodes",
    }
    runs = {REFERENCE: Run(2, FIELDS)} if users & names else {}
    if HALF in names:
        runs[HALF] = Run(4, dict(FIELDS, debug__fail_at_step=4), fails=True)
    return runs


@pytest.fixture(scope="module")
def two_rank_reference(batch_pool) -> dict[int, float]:
    """An uninterrupted 2-rank standalone run, the reference of the 2-rank and 2-node tests."""
    return run_losses(batch_pool.trained(pool_name(__name__, REFERENCE)))


@pytest.mark.slow
def test_killed_rank_is_restarted_and_resumes_bit_exact(tmp_path, two_rank_reference):
    run = tmp_path / "run"
    args = ["train", "--nproc", "2", "--max-restarts", "1"]
    for key, value in overrides(
        run,
        **FIELDS,
        debug__fail_at_step=4,
        debug__fail_rank=1,
        debug__fail_mode="kill",
    ):
        args += [f"--{key}", value]
    result = run_cli(*args, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]

    # Rank 1 died by SIGKILL as step 4 began; the second attempt resumed from step 2's
    # checkpoint, so step 3 ran (and was logged) in both attempts; readers see it once.
    assert "rank 1 crashes at step 4 (kill)" in (run / "logs" / "rank1.log").read_text()
    assert logged_steps(run, all_attempts=True) == [1, 2, 3, 3, 4, 5, 6]
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    # Same ranks, same reduction order, restored RNG and loader position: the same floats.
    assert run_losses(run) == two_rank_reference


@pytest.mark.slow
def test_resume_on_half_the_ranks_continues_the_run(tmp_path, check_ok, batch_pool):
    # The uninterrupted run's curve, from one process (in this one): every layout reproduces it
    # to 1e-5 (tests/test_parity.py), so a fourth launch of 4 ranks would prove nothing more.
    reference = losses(train_in_process(tmp_path / "ref", **FIELDS))
    crashed = batch_pool.result(pool_name(__name__, HALF))
    assert crashed.error is not None and "crashes at step 4" in crashed.error, crashed.error
    run = crashed.run_dir

    check_ok(train_cli(run, 2, **FIELDS))
    assert logged_steps(run, all_attempts=True) == [1, 2, 3, 3, 4, 5, 6]  # resumed from step 2
    assert "accumulation 2 x micro-batch 2" in (run / "logs" / "rank0.log").read_text()
    # 1e-5: 4 ranks with one micro-batch each, then 2 ranks accumulating 2, where one process
    # accumulates 4: the same 8 samples' gradients summed in another order (fp32 rounding,
    # ~1e-7 per step).
    assert_rel_close(run_losses(run), reference, rel=1e-5)


@pytest.mark.slow
def test_two_agents_rendezvous_as_two_nodes(tmp_path, two_rank_reference, monkeypatch):
    # Each agent would give its one worker all of this host's cores; the two nodes share them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_train(
            run,
            *("--nnodes", "2", "--nproc", "1", "--node-rank", str(node)),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", "test"),
            **FIELDS,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=120) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, stderr[-4000:]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    # 1e-5: which agent gets global rank 0 is the rendezvous's choice; if the two swap, each
    # rank's 4 samples are reduced in the other order (fp32 rounding only).
    assert_rel_close(run_losses(run), two_rank_reference, rel=1e-5)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--nnodes", "2:1"], "--nnodes 2:1: need 1 <= MIN <= MAX"),
        (["--nnodes", "1:x"], "--nnodes: expected N or MIN:MAX (integers), got '1:x'"),
        (["--nnodes", "2"], "--nnodes 2 lets other nodes join: give every node --rdzv-endpoint"),
        (["--rdzv-endpoint", "node0"], "--rdzv-endpoint: expected HOST:PORT"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"],
            "--node-rank must be in [0, 2)",
        ),
        # A fixed world size of 2 nodes x 3 = 6 ranks is validated before anything starts.
        (
            ["--nnodes", "2", "--nproc", "3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j"],
            "x data-parallel size (6, from world size 6)",
        ),
        # Without an id each launch has its own, and no other node could join.
        (
            ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1"],
            "--nnodes 1:2 lets other nodes join: give every node the same --rdzv-id",
        ),
    ],
)
def test_bad_launch_option_is_one_line_error(args, expected, capsys):
    result = cli_in_process(capsys, "train", *args)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert lines and expected in lines[0], result.stderr[-2000:]
