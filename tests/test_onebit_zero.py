"""1-bit Adam under ZeRO-1 (OneBitZeroAdam), on two gloo ranks in one spawn.

Warm-up: the same averaged gradients on both ranks must give plain AdamW's parameters while
each rank holds the moments of half the values. Past the freeze step each rank gets its own
gradients: the replicas must stay identical, the bytes counted must be the 1-bit exchange's
(~32x fewer than fp32), and a fresh optimizer loaded from the flattened state dict must
continue bit for bit in both phases. The saved state then loads into one process (a different
world size), which takes the whole moments. The end-to-end run (warm-up equal to Adam, loss
progress, bytes from the trainer's metrics) is tests/test_comm.py's zero1 case.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import process_group
from torch import nn

from distrain.optim.onebit_zero import OneBitZeroAdam
from distrain.optim.state_dict import load_optimizer_state_dict, optimizer_state_dict
from distrain.parallel.compress import CommStats

SHAPES = [(64, 32), (32,), (32, 32), (16, 32), (8,)]
FREEZE = 3
STEPS = 8
OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _model() -> nn.Module:
    return nn.ParameterDict(
        {f"p{i}": nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
         for i, s in enumerate(SHAPES)}
    )  # fmt: skip


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def _optimizer(model: nn.Module, stats: CommStats | None = None) -> OneBitZeroAdam:
    group = dist.group.WORLD if dist.is_initialized() else None
    return OneBitZeroAdam(_groups(model), **OPTIONS, freeze_step=FREEZE, group=group, stats=stats)


def _set_grads(model: nn.Module, step: int, rank: int) -> None:
    """Warm-up: the same (already averaged) gradient on every rank; then each rank's own."""
    seed = 1000 * step + (100 * rank if step >= FREEZE else 0)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i))


def _run(model: nn.Module, opt: OneBitZeroAdam, steps: range, rank: int) -> None:
    for step in steps:
        _set_grads(model, step, rank)
        opt.step()
        opt.zero_grad()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _snapshot(model: nn.Module, opt: OneBitZeroAdam) -> tuple[dict, dict]:
    saved = optimizer_state_dict(model, opt)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    return saved, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, store: Path, out: Path) -> None:
    with process_group(rank, 2, store_file=store, timeout_s=60):
        model, reference = _model(), _model()
        stats = CommStats()
        opt = _optimizer(model, stats)
        adamw = torch.optim.AdamW(_groups(reference), **OPTIONS, foreach=True)
        _run(reference, adamw, range(FREEZE), rank)
        saved = {}
        for step in range(STEPS):
            if step in (2, 5):  # in warm-up; past the freeze step, after two compressed steps
                saved[step] = _snapshot(model, opt)
            if step == FREEZE:
                torch.testing.assert_close(_flat(model), _flat(reference), rtol=1e-6, atol=1e-7)
                stats.reset()
            _run(model, opt, range(step, step + 1), rank)
        # Half the moments on each rank; the errors hold what compression dropped.
        n = sum(p.numel() for p in model.parameters())
        assert opt.exp_avg.numel() == opt.chunk and 2 * opt.chunk - n < 2 * 8 * opt.blocks
        assert opt.worker_error.abs().sum() > 0 and opt.server_error.abs().sum() > 0
        # Identical replicas although each rank trained on its own gradients.
        both = [torch.empty(n), torch.empty(n)]
        dist.all_gather(both, _flat(model))
        assert torch.equal(both[0], both[1])
        # Bytes: the signs and one fp32 scale per block, all-to-all then all-gather, against a
        # ring fp32 all-reduce of n values (4n bytes on 2 ranks); once, the fp32 all-gather of
        # this rank's chunk of the frozen variance.
        row = opt.block // 8 + 4
        per_step = 0.5 * (2 * opt.blocks * row) + opt.blocks * row
        compressed = STEPS - FREEZE
        assert stats.bytes_sent == compressed * per_step + 4 * opt.chunk
        assert stats.fp32_equivalent_bytes == compressed * 4 * n
        assert stats.fp32_equivalent_bytes / (stats.bytes_sent - 4 * opt.chunk) >= 31
        # A fresh optimizer loaded from each snapshot continues bit for bit.
        for step, (state, weights) in saved.items():
            restarted = _model()
            restarted.load_state_dict(weights)
            again = _optimizer(restarted)
            load_optimizer_state_dict(restarted, again, state)
            assert again.keeps_gradients_local() == (step >= FREEZE)
            _run(restarted, again, range(step, STEPS), rank)
            assert torch.equal(_flat(restarted), _flat(model)), step
        if rank == 0:
            torch.save(saved[5], out)


@pytest.mark.slow
def test_onebit_zero_is_sharded_adamw_then_one_bit_with_identical_replicas(tmp_path: Path):
    out = tmp_path / "saved.pt"
    mp.spawn(_worker, args=(tmp_path / "store", out), nprocs=2)
    # The two ranks' checkpoint loads into one process: whole moments, the phase kept.
    state, weights = torch.load(out, weights_only=True)
    model = _model()
    model.load_state_dict(weights)
    opt = _optimizer(model)
    load_optimizer_state_dict(model, opt, state)
    assert opt.steps_taken == 5 and opt.keeps_gradients_local()
    names = {id(p): name for name, p in model.named_parameters()}
    exp_avg = torch.cat([state[f"state.{names[id(p)]}.exp_avg"].reshape(-1) for p in opt._params])
    assert torch.equal(opt.exp_avg[: exp_avg.numel()], exp_avg) and exp_avg.abs().sum() > 0
    _run(model, opt, range(5, STEPS), 0)
    assert torch.isfinite(_flat(model)).all()


# --- ZeRO-2: the optimizer reduce-scatters each rank's own gradients ---------------------------

MAX_NORM = 10.0  # below the averaged gradients' norm (~37): clipping is on


def _zero2(model: nn.Module, stats: CommStats | None = None) -> OneBitZeroAdam:
    return OneBitZeroAdam(
        _groups(model), **OPTIONS, freeze_step=FREEZE, group=dist.group.WORLD, stats=stats,
        shard_gradients=True,
    )  # fmt: skip


def _own_grads(model: nn.Module, step: int, rank: int) -> None:
    for i, p in enumerate(model.parameters()):
        seed = 1000 * step + 100 * rank + i
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))


def _run_zero2(model: nn.Module, opt: OneBitZeroAdam, steps: range, rank: int) -> list:
    """The trainer's order: backward, `reduce_and_clip`, step; returns per step the norm, the
    gradient bytes held after `reduce_and_clip` and those held after the step."""
    seen = []
    for step in steps:
        _own_grads(model, step, rank)
        norm = opt.reduce_and_clip(MAX_NORM)
        held = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        held += opt._owned.nbytes if opt._owned is not None else 0
        opt.step()
        seen.append((norm, held, sum(p.grad is not None for p in model.parameters())))
        opt.zero_grad()
    return seen


def _zero2_worker(rank: int, store: Path) -> None:
    with process_group(rank, 2, store_file=store, timeout_s=60):
        model, reference = _model(), _model()
        n = sum(p.numel() for p in model.parameters())
        stats = CommStats()
        opt = _zero2(model, stats)
        adamw = torch.optim.AdamW(_groups(reference), **OPTIONS, foreach=True)
        saved, seen = {}, []
        for step in range(STEPS):
            if step in (2, 5):  # in warm-up; past the freeze step, after two compressed steps
                saved[step] = _snapshot(model, opt)
            if step == FREEZE:
                # Warm-up: AdamW on the two ranks' averaged gradients, clipped by their norm.
                torch.testing.assert_close(_flat(model), _flat(reference), rtol=1e-5, atol=1e-7)
                # Reduce-scatter plus parameter all-gather: an fp32 all-reduce's bytes (of the
                # padded vector).
                assert stats.bytes_sent == FREEZE * 2 * 0.5 * 4 * 2 * opt.chunk
                assert 1 <= stats.bytes_sent / stats.fp32_equivalent_bytes < 1.01
                stats.reset()
            if step < FREEZE:
                for i, p in enumerate(reference.parameters()):
                    p.grad = sum(
                        torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
                        for seed in (1000 * step + i, 1000 * step + 100 + i)
                    ) / 2  # fmt: skip
                want = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
                adamw.step()
                adamw.zero_grad()
            seen += _run_zero2(model, opt, range(step, step + 1), rank)
            if step < FREEZE:
                assert want > MAX_NORM
                torch.testing.assert_close(seen[-1][0], want, rtol=1e-5, atol=0)
        # Memory: after the warm-up exchange a rank holds only its chunk of the averaged
        # gradient, no local gradient: half the model's gradient bytes on 2 ranks (+ padding).
        for _, held, _ in seen[:FREEZE]:
            assert held == 4 * opt.chunk and 2 * held - 4 * n < 4 * 2 * 8 * opt.blocks
        # Past warm-up the local gradient is freed once compressed, inside the step.
        assert all(left == 0 for _, _, left in seen)
        both = [torch.empty(n), torch.empty(n)]
        dist.all_gather(both, _flat(model))
        assert torch.equal(both[0], both[1])
        # Past warm-up: the ZeRO-1 exchange; the frozen variance's fp32 all-gather once.
        compressed = stats.bytes_sent - 4 * opt.chunk
        assert stats.fp32_equivalent_bytes / compressed >= 31
        # A fresh optimizer loaded from each snapshot continues bit for bit.
        for step, (state, weights) in saved.items():
            restarted = _model()
            restarted.load_state_dict(weights)
            again = _zero2(restarted)
            load_optimizer_state_dict(restarted, again, state)
            _run_zero2(restarted, again, range(step, STEPS), rank)
            assert torch.equal(_flat(restarted), _flat(model)), step


@pytest.mark.slow
def test_onebit_zero2_reduce_scatters_clips_and_keeps_a_chunk_of_the_gradient(tmp_path: Path):
    mp.spawn(_zero2_worker, args=(tmp_path / "store",), nprocs=2)


def test_state_is_named_once_and_loads_into_a_fresh_optimizer():
    """The per-parameter state torch's flattened state dicts need is named at construction, not
    again at every step (one process): the same entries before and after steps; a state dict
    saved before any step (no zero-gradient step run by torch's helper: the step count stays 0)
    and one saved past the freeze step load into fresh optimizers."""
    model = _model()
    opt = _optimizer(model)
    named = {id(p): (opt.state[p], dict(opt.state[p])) for p in model.parameters()}
    assert all(set(entries) == {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error"}
               for _, entries in named.values())  # fmt: skip
    before = optimizer_state_dict(model, opt)
    assert opt.steps_taken == 0
    _run(model, opt, range(FREEZE + 2), rank=0)
    for p in model.parameters():
        state, entries = named[id(p)]
        assert opt.state[p] is state
        assert all(state[key] is value for key, value in entries.items())
    after = optimizer_state_dict(model, opt)
    for saved, steps in ((before, 0), (after, FREEZE + 2)):
        fresh = _model()
        loaded = _optimizer(fresh)
        load_optimizer_state_dict(fresh, loaded, saved)
        assert loaded.steps_taken == steps
    # The values, not the padding (past warm-up it decodes to +-scale, and is never read).
    assert torch.equal(loaded.exp_avg[: opt.valid], opt.exp_avg[: opt.valid])
    assert torch.equal(loaded.worker_error[: opt.numel], opt.worker_error[: opt.numel])
