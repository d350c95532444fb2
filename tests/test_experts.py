"""Expert-parallel dispatch and combine (distrain/parallel/experts.py) against running every
expert on one process: outputs, input gradients and expert weight gradients, with uneven splits
(one expert gets no rows at all) on a 2-rank gloo group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from distrain.models.decoder.moe import GroupedExperts
from distrain.parallel.compress import CommStats
from distrain.parallel.experts import ExpertParallel

NUM_EXPERTS, DIM, FFN = 4, 8, 16
# Rows per expert on each rank: uneven, expert 3 gets none from anyone.
ROWS = {0: [3, 1, 2, 0], 1: [1, 4, 0, 0]}


def _experts() -> nn.Module:
    torch.manual_seed(0)
    experts = GroupedExperts(NUM_EXPERTS, DIM, FFN)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    return experts


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    counts = torch.tensor(ROWS[rank], dtype=torch.int64)
    x = torch.randn(int(counts.sum()), DIM, generator=gen)
    upstream = torch.randn(int(counts.sum()), DIM, generator=gen)
    return x, counts, upstream


def _worker(rank: int, tmp_path: Path) -> None:
    with process_group(rank, 2, store_file=tmp_path / "store"):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        reference = _experts()
        stats = CommStats()
        ep = ExpertParallel(_experts(), mesh["ep"], stats=stats)
        # The names (so checkpoint keys and init values) of the weights it stands in for.
        assert [n for n, _ in ep.named_parameters()] == [n for n, _ in reference.named_parameters()]
        x, counts, upstream = _inputs(rank)
        x_ref = x.clone().requires_grad_()
        x.requires_grad_()
        out = ep(x, counts)
        (out * upstream).sum().backward()
        out_ref = reference(x_ref, counts)
        (out_ref * upstream).sum().backward()
        # Same arithmetic on the same rows (only the row order into the expert changes): exact
        # up to fp32 summation order inside the matmuls.
        torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        # An expert's weight gradient is the mean over the ranks of their rows' gradients (as
        # data parallelism averages): average the reference's, then compare this rank's half.
        for name, param in reference.named_parameters():
            full = param.grad.clone()
            dist.all_reduce(full)
            full /= 2
            sharded = getattr(ep, name)
            assert isinstance(sharded, DTensor) and sharded.shape == param.shape
            torch.testing.assert_close(
                sharded.grad.to_local(), full.chunk(2)[rank], rtol=1e-6, atol=1e-6
            )
            torch.testing.assert_close(sharded.to_local(), param.detach().chunk(2)[rank])
        # Rows sent to the other rank, there and back, times the row size.
        other = 1 - rank
        sent = sum(ROWS[rank][2 * other : 2 * other + 2])
        received = sum(ROWS[other][2 * rank : 2 * rank + 2])
        assert stats.snapshot()["bytes_sent"] == (sent + received) * DIM * 4


@pytest.mark.slow
def test_dispatch_combine_matches_local_experts(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(tmp_path,), nprocs=2)
