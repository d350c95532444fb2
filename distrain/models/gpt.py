"""Decoder-only GPT as a plain nn.Module: no parallel code lives here (see distrain/parallel/).

Attention goes through `scaled_dot_product_attention`; norms are RMSNorm or LayerNorm; positions
are rotary or learned. The attention module derives its local head count from its weight's shape,
so a tensor-parallel plan can shard heads without touching this file. Weights are initialized by
`init_weights`, which gives every parameter values determined by the seed and the parameter's name
alone, so any layout, any world size, gets the same model.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from distrain.models.moe import MoE, MoEArgs


@dataclass(kw_only=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 512
    max_seq_len: int = 1024
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    pos_emb: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    moe: MoEArgs = field(default_factory=MoEArgs)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")
        self.moe.check(self.n_layers)


def _norm(args: ModelArgs) -> nn.Module:
    if args.norm == "rmsnorm":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    return nn.LayerNorm(args.dim, eps=args.norm_eps, bias=False)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device) -> torch.Tensor:
    """cos/sin tables [seq_len, head_dim/2, 2], computed in fp32 whatever the model's dtype."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [B, T, H, D] by position; table is [T, D/2, 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[:, None, :, 0], table[:, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_up = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w_down = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


class Block(nn.Module):
    """Attention then a feed-forward layer: the dense `mlp`, or `moe` in the blocks that
    model.moe.every picks (the attribute name keeps checkpoint keys apart)."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attn_norm = _norm(args)
        self.attn = Attention(args)
        self.mlp_norm = _norm(args)
        if args.moe.is_moe_layer(layer):
            self.moe = _moe(args)
        else:
            self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.mlp_norm(x))


def _moe(args: ModelArgs) -> MoE:
    ffn_dim = args.moe.expert_ffn_dim(args.ffn_dim)
    shared = None
    if args.moe.shared_experts:
        shared = MLP(replace(args, ffn_dim=args.moe.shared_experts * ffn_dim))
    return MoE(args.dim, args.moe, ffn_dim, shared=shared)


class GPT(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]. Blocks live in a ModuleDict keyed "0".."n-1" so a
    pipeline split can delete some and keep the others' names (and so their checkpoint keys)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        args.check()
        self.args = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.dim)
        self.pos_emb = (
            nn.Embedding(args.max_seq_len, args.dim) if args.pos_emb == "learned" else None
        )
        self.blocks = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = _norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """A pipeline stage may lack the embedding (its input is then hidden states [B, T, D])
        or the head (it then returns hidden states); see parallel/pipeline.py."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds max_seq_len {self.args.max_seq_len}"
            )
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        rope = None
        if self.pos_emb is not None:
            h = h + self.pos_emb(torch.arange(seq, device=tokens.device))
        elif self.args.pos_emb == "rope":
            rope = rope_tables(self.args.head_dim, seq, self.args.rope_theta, tokens.device)
        for block in self.blocks.values():
            h = block(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper prefixes (DDP, compile, activation checkpointing) removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_init_std(name: str, args: ModelArgs) -> float | None:
    """The init of one parameter by name: a normal std, or None for ones (norm weights).

    GPT-2's scheme: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 L).
    """
    if "norm" in name:
        return None
    if name.endswith(
        ("attn.wo.weight", "mlp.w_down.weight", "shared.w_down.weight", "experts.w_down")
    ):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


def full_init_value(name: str, shape: torch.Size, args: ModelArgs, seed: int) -> torch.Tensor:
    """The unsharded fp32 initial value of parameter `name`, from the seed and the name alone."""
    name = canonical_name(name)
    std = param_init_std(name, args)
    if std is None:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(model: nn.Module, args: ModelArgs, seed: int) -> None:
    """Fill every materialized parameter with its seeded, layout-independent value.

    Values are made on CPU in fp32 as the full tensor; a sharded (DTensor) parameter keeps only
    its own slice of it. So a model initialized on 1 rank or on 8, under any layout, is the same.
    The MoE expert bias (a buffer) starts at zero.
    """
    for name, param in model.named_parameters():
        value = full_init_value(name, param.shape, args, seed).to(param.device, param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)
    for module in model.modules():
        if isinstance(module, MoE):
            module.expert_bias.zero_()
