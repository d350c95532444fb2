"""training.micro_batch_size = "auto": the largest micro-batch whose measured trial step fits the
budget is chosen (the next size up measured over it), the same on every rank, and the run's loss
curve equals the run with that size set by hand."""

from __future__ import annotations

import pytest
from helpers import losses, train_cli, train_in_process

from distrain.observe.metrics import read_metrics
from distrain.train.autobatch import MicroBatchDoesNotFit, Trial, candidates, first_probe, search

GIB = 2**30
# Tiny and deterministic: dim 64, 2 layers, 32 tokens, 16 sequences per step, 3 steps.
BASE = {
    "model__dim": 64,
    "model__n_layers": 2,
    "model__ffn_dim": 256,
    "training__seq_len": 32,
    "training__global_batch_size": 16,
    "training__steps": 3,
    "training__deterministic": True,
    "training__eval_batches": 1,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
# fp32 sums over another accumulation split (2 ranks x micro-batch 2 against 1 rank x 2) move
# the loss by ~1e-7 per step (see test_parity.py); 1e-5 leaves room for 3 steps of that.
REL_TOL = 1e-5


def _choice(rows: list[dict]) -> dict:
    (row,) = [r for r in rows if "auto_micro_batch_size" in r]
    return row


def test_search_keeps_to_divisors_and_stops_below_the_first_failure():
    assert candidates(24, 2) == [1, 2, 3, 4, 6, 12]
    sizes, seen = candidates(64, 1), []

    def trial(m: int) -> Trial:
        seen.append(m)
        peak = 100 + 10 * m
        return Trial(m, peak, False, peak <= 400)

    trials = search(sizes, trial, budget=400)
    # The slope of the first two trials (10 bytes per sequence) points at 16 straight away.
    assert first_probe(sizes, (110, 120), 400) == sizes.index(16)
    assert seen == [1, 2, 16, 32]
    assert max(t.micro_batch_size for t in trials if t.fits) == 16


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[int, int]:
    """Peak bytes of the trial steps at micro-batch 1 and 2, from a run with room for all."""
    rows = train_in_process(
        tmp_path_factory.mktemp("probe") / "run",
        **dict(BASE, training__steps=1),
        training__micro_batch_size="auto",
        training__memory_budget_gb=64,
    )
    trials = {t["micro_batch_size"]: t for t in _choice(rows)["auto_micro_batch_trials"]}
    assert _choice(rows)["auto_micro_batch_size"] == 16 and trials[16]["fits"]
    return trials[1]["peak_bytes"], trials[2]["peak_bytes"]


def _budget_gb(measured: tuple[int, int], sequences: float) -> float:
    """A budget between the peaks the measured slope gives micro-batches 4 and 8."""
    one, two = measured
    return (one + (sequences - 1) * (two - one)) / GIB


def _assert_largest_that_fits(choice: dict) -> int:
    budget, trials = choice["auto_memory_budget_bytes"], choice["auto_micro_batch_trials"]
    chosen = choice["auto_micro_batch_size"]
    by_size = {t["micro_batch_size"]: t for t in trials}
    assert by_size[chosen]["fits"] and by_size[chosen]["peak_bytes"] <= budget
    bigger = [m for m in by_size if m > chosen]
    assert bigger, "the next size up was not tried"
    above = by_size[min(bigger)]
    assert not above["fits"]
    return above


def test_one_rank_chooses_the_largest_that_fits_and_keeps_the_loss(tmp_path, measured):
    rows = train_in_process(
        tmp_path / "auto",
        **BASE,
        training__micro_batch_size="auto",
        training__memory_budget_gb=_budget_gb(measured, 6),
    )
    choice = _choice(rows)
    above = _assert_largest_that_fits(choice)
    assert above["peak_bytes"] > choice["auto_memory_budget_bytes"] and not above["out_of_memory"]
    assert choice["auto_micro_batch_size"] == 4
    fixed = train_in_process(tmp_path / "fixed", **BASE, training__micro_batch_size=4)
    assert losses(rows) == losses(fixed)  # same size, same order of every sum: bit-exact


def test_a_budget_below_micro_batch_one_is_a_clear_error(tmp_path, measured):
    with pytest.raises(MicroBatchDoesNotFit) as info:
        train_in_process(
            tmp_path / "run",
            **BASE,
            training__micro_batch_size="auto",
            training__memory_budget_gb=measured[0] / 2 / GIB,
        )
    message = str(info.value)
    assert "training.micro_batch_size = 'auto': even micro-batch 1 needs" in message
    assert "raise training.memory_budget_gb" in message and "\n" not in message


@pytest.mark.slow
def test_two_ranks_agree_on_a_smaller_size_after_an_injected_oom(tmp_path, measured, check_ok):
    """Rank 1 alone runs out of memory at micro-batch 4, which fits the budget: every rank
    picks 2, and the curve equals the 1-process run at micro-batch 2."""
    result = check_ok(
        train_cli(
            tmp_path / "auto",
            2,
            **BASE,
            training__micro_batch_size="auto",
            training__memory_budget_gb=_budget_gb(measured, 6),
            debug__oom_at_micro_batch=4,
            debug__oom_rank=1,
        )
    )
    rows = read_metrics(tmp_path / "auto" / "metrics.jsonl")
    choice = _choice(rows)
    assert choice["auto_micro_batch_size"] == 2, result.stderr
    above = _assert_largest_that_fits(choice)
    assert above["micro_batch_size"] == 4 and above["out_of_memory"]
    for rank in (0, 1):
        log = (tmp_path / "auto" / "logs" / f"rank{rank}.log").read_text()
        assert "training.micro_batch_size auto: 2 " in log
    fixed = train_in_process(tmp_path / "fixed", **BASE, training__micro_batch_size=2)
    got, want = losses(rows), losses(fixed)
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= REL_TOL * want[step], (step, got[step], want[step])


def test_trials_leave_no_trace_in_moe_routing_statistics(tmp_path):
    """With balance = 'bias' each step's expert load moves the routing bias: the trials' forward
    calls must not count in the first step's load, or the curve would leave the fixed run's."""
    moe = dict(
        BASE,
        model__preset="moe-tiny",
        model__moe__balance="bias",
        model__moe__bias_update_rate=0.1,
        training__steps=2,  # step 1's load moves the bias that step 2 routes with
    )
    rows = train_in_process(
        tmp_path / "auto", **moe, training__micro_batch_size="auto", training__memory_budget_gb=64
    )
    assert _choice(rows)["auto_micro_batch_size"] == 16
    fixed = train_in_process(tmp_path / "fixed", **moe, training__micro_batch_size=16)
    assert losses(rows) == losses(fixed)


def test_a_run_decides_auto_without_changing_the_config(tmp_path):
    """precision, compile and micro_batch_size "auto" are decided once into the run's plan
    (train/resolve.py): the Config object the run was given is equal afterwards to a copy taken
    before, config.toml keeps "auto", and the log and metrics say what "auto" became."""
    import copy

    import torch
    from helpers import overrides

    from distrain.config.io import load_config
    from distrain.train.worker import run_training

    run = tmp_path / "run"
    cfg = load_config(
        None,
        overrides(
            run,
            **dict(BASE, training__steps=1),
            training__micro_batch_size="auto",
            training__memory_budget_gb=64,
            training__precision="auto",
            training__compile="auto",
        ),
    )
    before = copy.deepcopy(cfg)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        run_training(cfg)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert cfg == before
    written = (run / "config.toml").read_text()
    for field in ("precision", "compile", "micro_batch_size"):
        assert f'{field} = "auto"' in written, field
    log = (run / "logs" / "rank0.log").read_text()
    assert "training.precision auto: " in log and "training.compile auto: False" in log
    assert _choice(read_metrics(run / "metrics.jsonl"))["auto_micro_batch_size"] == 16
