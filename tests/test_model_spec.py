"""A model family defined only here, not a GPT, trains at parity with one process under dp2, tp2
and pp2 through the parallel mechanisms, which know it only by its `ModelSpec`.

The family: a residual MLP language model (`embed` -> `layers` of norm + MLP -> `ln_f` ->
`unembed`), with block and submodule names of its own, its own seeded init, its own
tensor-parallel plan and pipeline split. It is registered from this file and the workers look it
up by name, as the trainer looks up a family. The three layouts run in turn in one spawn of 2
processes (spawning costs seconds on CI's 2 cores).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from distrain.config.schema import Config
from distrain.layout.rules import validate
from distrain.models.registry import model_family, register_family
from distrain.parallel.compress import CommStats
from distrain.parallel.device import DistContext
from distrain.parallel.model import build_parallel_model
from distrain.parallel.spec import ModelSpec, Source
from distrain.parallel.tensor import ReplicatedParallel
from distrain.torch_compat import canonical_name

WORLD_SIZE = 2
SEED = 5
STEPS = 4
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 16
LR = 0.5
# fp32 everywhere, one seed, one global batch per step: each layout computes the same sums in
# another order (DDP averages two half-batch gradients, tp all-reduces row-parallel partial
# sums and the vocab-parallel logsumexp, pp scales summed micro-batch gradients), so the
# per-step losses differ by rounding only (a few ulps of a loss near 4.2, ~1e-6 relative),
# amplified a little by each SGD step. 1e-5 relative (test_parity's REL_TOL) leaves that room
# and still fails a real layout bug (a lost gradient or a wrong shard moves the loss by 1e-3+).
REL_TOL = 1e-5


@dataclass(frozen=True, kw_only=True)
class ResidualMLPArgs:
    vocab_size: int = 64
    dim: int = 32
    hidden: int = 64
    n_layers: int = 4


class MLPBlock(nn.Module):
    def __init__(self, args: ResidualMLPArgs):
        super().__init__()
        self.ln = nn.LayerNorm(args.dim)
        self.up = nn.Linear(args.dim, args.hidden)
        self.down = nn.Linear(args.hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class ResidualMLPLM(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]; a pipeline stage without `embed` takes hidden
    states, one without `unembed` returns them."""

    def __init__(self, args: ResidualMLPArgs):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.unembed = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.unembed is None:
            return h
        return self.unembed(self.ln_f(h))


@torch.no_grad()
def init_weights(
    model: nn.Module, args: ResidualMLPArgs, seed: int, *, source: Source | None = None
) -> None:
    """Each parameter's value from the seed and its name alone; a DTensor keeps its slice."""
    for name, param in model.named_parameters():
        name = canonical_name(name)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        value = torch.randn(param.shape, generator=gen) * 0.2
        if name.endswith("ln.weight") or name == "ln_f.weight":
            value = torch.ones(param.shape)
        if isinstance(param, DTensor):
            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(value)
        else:
            param.copy_(value)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed over the targets, as a spec's loss is (the caller divides by their count)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), reduction="sum")


def tensor_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The embedding and head split over the vocabulary, each MLP Megatron-style; the norms
    replicated. No sequence-parallel variant."""
    if sequence_parallel:
        raise ValueError("the residual MLP has no sequence-parallel plan")
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for key in model.layers:
        plan[f"layers.{key}.ln"] = ReplicatedParallel()
        plan[f"layers.{key}.up"] = ColwiseParallel()
        plan[f"layers.{key}.down"] = RowwiseParallel()
    if model.ln_f is not None:
        plan["ln_f"] = ReplicatedParallel()
    if model.unembed is not None:
        plan["unembed"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


SPEC = ModelSpec(
    name="residual_mlp",
    args_type=ResidualMLPArgs,
    build=ResidualMLPLM,
    init_weights=init_weights,
    loss=loss,
    blocks="layers",
    first_stage=("embed",),
    last_stage=("ln_f", "unembed"),
    tensor_plan=tensor_plan,
)
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
    # The GPT shape the layout rules check (their divisibility rules); the model built is
    # the residual MLP's.
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads = ResidualMLPArgs().n_layers, 32, 2
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel = tp, pp, False
    t = cfg.training
    t.global_batch_size, t.micro_batch_size, t.seq_len = GLOBAL_BATCH, MICRO_BATCH, SEQ
    t.precision, t.compile, t.activation_checkpointing, t.seed = "fp32", False, ac, SEED
    return cfg


def _parallel(rank: int, tp: int, pp: int, ac: str) -> list[float]:
    cfg = _config(tp, pp, ac)
    layout = validate(cfg, WORLD_SIZE)
    dims = layout.dims
    mesh, dp_mesh = dims.build_mesh("cpu")
    ctx = DistContext(
        rank=rank,
        local_rank=rank,
        world_size=WORLD_SIZE,
        device=torch.device("cpu"),
        backend="gloo",
    )
    model = build_parallel_model(
        ResidualMLPArgs(),
        cfg,
        dims,
        mesh,
        dp_mesh,
        ctx,
        CommStats(),
        spec=model_family("residual_mlp"),
    )
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
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/store",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        results = {"one_process": _one_process()}
        for name, layout in LAYOUTS.items():
            results[name] = _parallel(rank, *layout)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()  # neither rank tears its groups down while the other still uses them
    finally:
        dist.destroy_process_group()


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


def test_the_registry_finds_a_family_by_name_and_by_its_arguments():
    from distrain.models.registry import family_of

    assert model_family("residual_mlp") is SPEC
    assert family_of(ResidualMLPArgs()) is SPEC
    assert model_family("gpt").blocks == "blocks"
