"""ZeRO-1 for tp/pp layouts (Zero1AdamW): the state is split, the update is AdamW's.

Two gloo ranks hold the same DTensor parameters (replicated over their 2-rank mesh, as FSDP2's
replication leaves them under tp/pp) and the same gradients; three steps must match one
process's AdamW to the last bit (the same elementwise arithmetic, one rank computing it), and
each rank must hold the state of its own share of the parameters only. The end-to-end proof
under tp and pp is in the parity matrix (zero1x2_tp2, pp2_zero1x2_tied).
"""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from distrain.optim.state_dict import load_optimizer_state_dict, optimizer_state_dict
from distrain.optim.zero1 import Zero1AdamW, owners

SHAPES = [(64, 32), (32,), (32, 32), (16, 32), (8,)]
OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": True}


def _model() -> nn.Module:
    model = nn.ParameterDict(
        {f"p{i}": nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
         for i, s in enumerate(SHAPES)}
    )  # fmt: skip
    return model


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def _grad(step: int, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))


def _reference() -> list[torch.Tensor]:
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(_groups(params), **OPTIONS)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = _grad(step, i, p.shape)
        opt.step()
    return [p.detach().clone() for p in params]


def _worker(rank: int, store: Path) -> None:
    with process_group(rank, 2, store_file=store, timeout_s=60):
        mesh = init_device_mesh("cpu", (2,))
        model = _model()
        for name, p in list(model.items()):
            model[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
        params = list(model.parameters())
        opt = Zero1AdamW(_groups(params), group=mesh.get_group(), **OPTIONS)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = distribute_tensor(_grad(step, i, p.shape), mesh, [Replicate()])
            opt.step()
        for got, want in zip(params, _reference(), strict=True):
            torch.testing.assert_close(got.to_local(), want, rtol=0, atol=0)
        mine = [i for i, r in enumerate(owners(params, 2)) if r == rank]
        state = opt.optim.state
        assert sorted(id(p) for p in state) == sorted(id(params[i]) for i in mine)
        held = sum(params[i].numel() for i in mine)
        assert 0.4 < held / sum(p.numel() for p in params) < 0.6
        # Saved under the parameters' names, this rank's share only; loads back in place.
        saved = optimizer_state_dict(model, opt)
        exp_avg = {k for k in saved if k.startswith("state.") and k.endswith(".exp_avg")}
        assert exp_avg == {f"state.p{i}.exp_avg" for i in mine}
        before = {k: v.to_local().clone() for k, v in saved.items() if k in exp_avg}
        # The saved tensors are the live state (nothing copied): clone before clearing it.
        saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
        for p in state.values():
            p["exp_avg"].zero_()
        load_optimizer_state_dict(model, opt, saved)
        for key, value in before.items():  # (loading replaces the state dict object)
            index = int(key.split(".")[1][1:])
            loaded = opt.optim.state[params[index]]["exp_avg"]
            torch.testing.assert_close(loaded.to_local(), value, rtol=0, atol=0)


def test_owners_balance_and_agree():
    params = [nn.Parameter(torch.empty(s)) for s in SHAPES]
    split = owners(params, 2)
    assert split == owners(params, 2) and set(split) == {0, 1}
    assert owners(params, 1) == [0] * len(params)
    assert owners(params[:2], 3) == [0, 1]  # more ranks than parameters: rank 2 owns nothing


@pytest.mark.slow
def test_zero1_adamw_matches_adamw_with_half_the_state(tmp_path: Path):
    mp.spawn(_worker, args=(tmp_path / "store",), nprocs=2)
