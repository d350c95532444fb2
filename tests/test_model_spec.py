"""A model family defined outside distrain, not a GPT, trains at parity with one process under
dp2, tp2 and pp2 through the parallel mechanisms, which know it only by its `ModelSpec`.

The family: tests/plugins/distrain_residual_mlp/, a residual MLP language model (`embed` ->
`layers` of norm + MLP -> `ln_f` -> `unembed`), with block and submodule names of its own, its
own seeded init, its own tensor-parallel plan and pipeline split. It is registered from this
file and the workers look it up by name, as the trainer looks up a family. The three layouts run
in turn in one spawn of 2 processes (spawning costs seconds on CI's 2 cores). How the trainer
finds it through its entry point, from a TOML config, is tests/test_family_plugin.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distrain_residual_mlp.model import ResidualMLPArgs
from distrain_residual_mlp.spec import SPEC
from helpers import plan_of, process_group

from distrain.config.schema import Config
from distrain.models.registry import model_family, register_family
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext
from distrain.parallel.parallelize import parallelize

WORLD_SIZE = 2
SEED = 5
STEPS = 4
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 16
LR = 0.5
# fp32 everywhere, one seed, one global batch per step: each layout computes the same sums in
# another order (DDP averages two half-batch gradients, tp all-reduces row-parallel partial
# sums and the vocab-parallel logsumexp, pp scales summed micro-batch gradients), so the
# per-step losses differ by rounding only (a few ulps of a loss near 5.5, ~1e-6 relative),
# amplified a little by each SGD step. 1e-5 relative (test_parity's REL_TOL) leaves that room
# and still fails a real layout bug (a lost gradient or a wrong shard moves the loss by 1e-3+).
REL_TOL = 1e-5


register_family(SPEC)

# name -> (parallel.tp, parallel.pp, activation checkpointing): dp2 also wraps the family's
# blocks in activation checkpointing, through the spec's `blocks`.
LAYOUTS = {"dp2": (1, 1, "full"), "tp2": (2, 1, "none"), "pp2": (1, 2, "none")}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    vocab = ResidualMLPArgs().vocab_size
    tokens = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _micro(inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    return list(zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH), strict=True))


def _one_process() -> list[float]:
    """The reference: the plain model, the whole global batch, micro-batch accumulation."""
    spec, args = model_family("residual_mlp"), ResidualMLPArgs()
    model = spec.build(args)
    spec.init_weights(model, args, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    result = []
    for inputs, targets in _batches():
        micro = _micro(inputs, targets)
        total = 0.0
        for x, y in micro:
            step_loss = spec.loss(model(x), y) / y.numel()
            (step_loss / len(micro)).backward()
            total += step_loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.append(total / len(micro))
    return result


def _config(tp: int, pp: int, ac: str) -> Config:
    cfg = Config()
    cfg.model.family, cfg.model.preset = "residual_mlp", "rmlp-tiny"
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel = tp, pp, False
    t = cfg.training
    t.global_batch_size, t.micro_batch_size, t.seq_len = GLOBAL_BATCH, MICRO_BATCH, SEQ
    t.precision, t.compile, t.activation_checkpointing, t.seed = "fp32", False, ac, SEED
    return cfg


def _parallel(rank: int, tp: int, pp: int, ac: str) -> list[float]:
    plan = plan_of(_config(tp, pp, ac), WORLD_SIZE)
    dims = plan.dims
    mesh, dp_mesh = dims.build_mesh("cpu")
    ctx = DistContext(
        rank=rank,
        local_rank=rank,
        world_size=WORLD_SIZE,
        device=torch.device("cpu"),
        backend="gloo",
    )
    model = parallelize(plan, mesh, dp_mesh, ctx, CommStats())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank, rows = dp_mesh.get_local_rank(), GLOBAL_BATCH // dims.dp_size
    result = []
    for inputs, targets in _batches():
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        step_loss = model.forward_backward(_micro(inputs[mine], targets[mine]), lambda x: x)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss, group=dp_mesh.get_group())
        result.append(step_loss.item() / dims.dp_size)
    return result


def _worker(rank: int, tmp_path: Path) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    with process_group(rank, WORLD_SIZE, store_file=tmp_path / "store", timeout_s=60):
        results = {"one_process": _one_process()}
        for name, layout in LAYOUTS.items():
            results[name] = _parallel(rank, *layout)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()  # neither rank tears its groups down while the other still uses them


@pytest.mark.slow
def test_a_family_defined_here_trains_at_parity_under_dp_tp_and_pp(tmp_path):
    mp.spawn(_worker, args=(tmp_path,), nprocs=WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = results.pop("one_process")
        assert want[-1] < want[0]  # it trains
        assert results.keys() == LAYOUTS.keys()
        for name, got in results.items():
            worst = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
            assert worst <= REL_TOL, (name, got, want)


def test_the_registry_finds_a_family_by_name():
    assert model_family("residual_mlp") is SPEC
    assert model_family("gpt").blocks == "blocks"
