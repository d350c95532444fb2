"""The residual MLP language model: `embed` -> `layers` of norm + MLP -> `ln_f` -> `unembed`, its
arguments, its seeded init and its loss."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from distrain.family.spec import Source
from distrain.torch_compat import canonical_name


@dataclass(frozen=True, kw_only=True)
class ResidualMLPArgs:
    vocab_size: int = 256
    dim: int = 32
    hidden: int = 64
    n_layers: int = 4
    max_seq_len: int = 1024
    """The longest sequence it is trained on (the model itself has no positions)."""


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
    """Summed over the targets, as a spec's loss is (the caller divides by their count);
    negative targets (cross_entropy's ignore_index) are skipped."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), reduction="sum")
