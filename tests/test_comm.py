"""Gradient communication end to end (2-4 ranks through `distrain train`): compression hooks
train close to the uncompressed run and report their bytes; 1-bit Adam equals Adam during
warm-up and then sends >= 16x fewer bytes; hierarchical all-reduce across two torchrun agents
("nodes") equals the flat all-reduce. Unit-level checks of the hooks are in test_compress.py."""

import copy

import pytest
import torch
from helpers import free_port, losses, overrides, start_train, train_cli

from distrain.config_io import load_config
from distrain.models.presets import model_args, num_params
from distrain.observe.metrics import read_metrics
from distrain.optim import load_optimizer_state_dict, optimizer_state_dict, param_groups
from distrain.parallel.onebit_adam import OneBitAdam

STEPS = 12
FIELDS = {
    "training__steps": STEPS,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 4,
    "training__seq_len": 64,
    "optim__warmup_steps": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


def _rows(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    run = tmp_path_factory.mktemp("none") / "run"
    result = train_cli(run, 2, **FIELDS)
    assert result.returncode == 0, result.stderr[-3000:]
    return _rows(run)


# (kind, relative final-loss tolerance vs uncompressed after 12 steps, least bytes ratio).
# fp16/bf16 round each gradient once (2^-11 / 2^-8 relative); PowerSGD (rank 2) and 1-bit signs
# lose far more per step but carry it forward by error feedback, so they trail by a few percent.
HOOKS = [
    ("fp16", 1e-3, 2.0),
    ("bf16", 1e-2, 2.0),
    ("powersgd", 0.1, 1.5),
    ("onebit", 0.1, 16.0),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "tolerance", "ratio"), HOOKS, ids=[h[0] for h in HOOKS])
def test_compression_hook_trains_close_to_uncompressed(
    kind, tolerance, ratio, uncompressed, tmp_path, check_ok
):
    run = tmp_path / "run"
    check_ok(
        train_cli(run, 2, **FIELDS, comm__gradient_compression=kind, comm__powersgd_start_step=2)
    )
    rows = _rows(run)
    final, reference = rows[-1]["loss"], uncompressed[-1]["loss"]
    assert final < rows[0]["loss"]
    assert abs(final - reference) <= tolerance * reference, (kind, final, reference)
    assert rows[-1]["comm_compression_ratio"] >= ratio
    assert uncompressed[-1]["comm_compression_ratio"] == 1.0
    assert all(r["comm_bytes"] > 0 and r["comm_time_s"] > 0 for r in rows)


@pytest.mark.slow
def test_plain_allreduce_is_counted_without_a_hook(uncompressed, tmp_path):
    cfg = load_config(None, overrides(tmp_path, **FIELDS))
    params = num_params(model_args(cfg.model, seq_len=cfg.training.seq_len))
    # Every step all-reduces every fp32 gradient once (DDP's built-in path, no Python hook): the
    # bytes are the parameters', and nothing times it.
    assert [r["comm_bytes"] for r in uncompressed] == [4.0 * params] * STEPS
    assert all(r["comm_compression_ratio"] == 1.0 for r in uncompressed)
    assert not any("comm_time_s" in r for r in uncompressed)


@pytest.mark.slow
def test_onebit_adam_is_adam_then_sends_16x_less(uncompressed, tmp_path, check_ok):
    freeze = 5
    run = tmp_path / "run"
    check_ok(
        train_cli(run, 2, **FIELDS, optim__name="onebit_adam", optim__onebit__freeze_step=freeze)
    )
    rows, adam = _rows(run), uncompressed
    # Warm-up: the same AdamW math on the same all-reduced gradients; per-parameter vs foreach
    # kernels round differently (~1e-7), hence 1e-6. Loss at step k+1 reflects k updates.
    for got, want in zip(rows[: freeze + 1], adam[: freeze + 1], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], (got, want)
    # Past the freeze step only the 1-bit momentum exchange is on the wire.
    for row in rows[freeze + 1 :]:
        assert row["comm_fp32_bytes"] / row["comm_bytes"] >= 16, row
    # Fixed budget: frozen variance and compressed momentum trail Adam by a few percent here.
    assert abs(rows[-1]["loss"] - adam[-1]["loss"]) <= 0.1 * adam[-1]["loss"]


@pytest.mark.slow
def test_hierarchical_all_reduce_across_two_agents_equals_flat(tmp_path, check_ok):
    fields = dict(FIELDS, training__micro_batch_size=2)
    check_ok(train_cli(tmp_path / "flat", 4, **fields))
    run = tmp_path / "hier"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_train(
            run,
            *("--nnodes", "2", "--nproc", "2", "--node-rank", str(node)),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", "hier"),
            **fields,
            comm__hierarchical=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        _, stderr = agent.communicate(timeout=180)
        assert agent.returncode == 0, stderr[-3000:]
    want = losses(read_metrics(tmp_path / "flat" / "metrics.jsonl"))
    got = losses(read_metrics(run / "metrics.jsonl"))
    # 1e-6: reduce-then-all-reduce adds the four ranks' fp32 gradients in another order.
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6 * want[step], (step, got[step], want[step])


@pytest.mark.slow
def test_onebit_adam_refuses_sharded_data_parallel(tmp_path):
    result = train_cli(
        tmp_path / "run", 2, **FIELDS, optim__name="onebit_adam", parallel__zero_stage=2
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert errors and "it does not compose with sharded data parallel" in errors[0]


def _onebit(model: torch.nn.Module) -> OneBitAdam:
    return OneBitAdam(
        param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, freeze_step=3, group=None
    )


def _steps(model: torch.nn.Module, optimizer: OneBitAdam, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize("resume_at", [2, 5], ids=["in_warmup", "past_freeze"])
def test_onebit_adam_state_dict_continues_bit_exact(resume_at):
    """Through the trainer's flattened, name-keyed optimizer state dict (one process): a fresh
    optimizer loaded at step `resume_at` continues exactly as the uninterrupted one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    initial = copy.deepcopy(model.state_dict())
    running = _onebit(model)
    _steps(model, running, range(resume_at))
    saved = {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in optimizer_state_dict(model, running).items()
    }
    weights = copy.deepcopy(model.state_dict())
    _steps(model, running, range(resume_at, 8))

    restarted = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    restarted.load_state_dict(initial)
    optimizer = _onebit(restarted)
    load_optimizer_state_dict(restarted, optimizer, saved)
    restarted.load_state_dict(weights)
    assert optimizer.keeps_gradients_local() == (resume_at >= 3)
    if resume_at >= 3:
        # Two compressed steps: the worker error holds something to restore. (With one rank the
        # server re-compresses values that are already +-scale: its error stays zero. The
        # 2-rank resume in test_resume_exact.py restores a non-zero one.)
        errors = [v for k, v in saved.items() if k.endswith("worker_error.rank0")]
        assert len(errors) == 4 and all(e.abs().sum() > 0 for e in errors)
    _steps(restarted, optimizer, range(resume_at, 8))
    for got, want in zip(restarted.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
