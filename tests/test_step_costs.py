"""Per-step costs a GPU job should not pay, and the results that must not change for it: the
pipeline loss crosses ranks only on steps whose loss is read; FSDP keeps pipeline stages'
parameters gathered between micro-batches (parity with one process). DDP's side is in
test_ddp.py and test_comm.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from batch import Run, pool_name
from helpers import losses, train_in_process

from distrain.observe.metrics import read_metrics
from distrain.parallel.model import ParallelModel


class _Runner:
    """A pipeline stage's schedule, as ParallelModel drives it: counts loss broadcasts."""

    def __init__(self, local_loss: torch.Tensor | None):
        self.local_loss, self.broadcasts = local_loss, 0

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        scale: object = None,
        *,
        loss_divisor: object = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        return self.local_loss

    def broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        self.broadcasts += 1
        return torch.tensor(3.25)  # what the last stage holds


def _pipeline_model(runner: _Runner) -> ParallelModel:
    model = object.__new__(ParallelModel)
    model.runner, model.device = runner, torch.device("cpu")
    model.dims, model.autocast = SimpleNamespace(tp=1, cp=1), contextlib.nullcontext()
    model.tied = None  # no tied embedding across stages
    model.sequence_split = None  # no context parallelism
    model.train_batch_rows = 2  # the local batch the schedule runs (the test's batch)
    return model


@pytest.mark.parametrize("last_stage", [True, False], ids=["last_stage", "first_stage"])
def test_pipeline_loss_is_broadcast_only_when_reported(last_stage):
    runner = _Runner(torch.tensor(3.25) if last_stage else None)
    model = _pipeline_model(runner)
    batch = [(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))]
    unreported = model.forward_backward(batch, lambda loss: loss, report_loss=False)
    assert runner.broadcasts == 0
    assert float(unreported) == (3.25 if last_stage else 0.0)
    reported = model.forward_backward(batch, lambda loss: loss)
    assert runner.broadcasts == 1 and float(reported) == 3.25


BASE = {
    "training__steps": 6,
    "training__global_batch_size": 8,
    "training__seq_len": 64,
    "training__micro_batch_size": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


PP_ZERO3 = "test_pp_zero3_logging_every_third_step_matches_single_process"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The 4-rank run, where its test is selected (tests/batch.py's pool: it shares the
    session's 4-rank torchrun launch)."""
    fields = dict(BASE, parallel__pp=2, parallel__zero_stage=3, training__log_interval_steps=3)
    return {PP_ZERO3: Run(4, fields)} if PP_ZERO3 in names else {}


@pytest.mark.slow
def test_pp_zero3_logging_every_third_step_matches_single_process(tmp_path, batch_pool):
    """pp2 x dp2 ZeRO-3 (stages not resharded after forward), logging at steps 3 and 6 only:
    steps 1, 2, 4 and 5 broadcast no loss, and the logged losses (a world mean that includes
    the first stage's ranks) equal the 1-process run's."""
    reference = losses(
        train_in_process(tmp_path / "ref", **dict(BASE, training__micro_batch_size=8))
    )
    run_dir = batch_pool.trained(pool_name(__name__, PP_ZERO3))
    got = losses(read_metrics(run_dir / "metrics.jsonl"))
    assert got.keys() == {3, 6}
    # 1e-5 relative, as in test_parity.py: sharded reductions sum in another order (~1e-7).
    for step, loss in got.items():
        assert abs(loss - reference[step]) <= 1e-5 * reference[step], (step, loss, reference)
