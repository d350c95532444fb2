"""The decoder-only transformer every built-in family builds (`Decoder`), as a plain nn.Module:
no parallel code lives here (its plans are parallelize.py's and spec.py's, applied by
distrain/parallel/).

Attention goes through `scaled_dot_product_attention`, with grouped-query attention when there are
fewer key/value heads than query heads; norms are RMSNorm or LayerNorm; positions are rotary (the
rotate-half layout of Hugging Face's Llama, with Llama 3's frequency scaling) or learned; the MLP
is GELU (GPT-2) or SwiGLU (Llama); biases are optional (GPT-2 has them). The attention module
derives its local head counts from its weights' shapes, so a tensor-parallel plan can shard heads
without touching this file. Weights are initialized by `init_weights`, which gives every parameter
values determined by the seed and the parameter's name alone (or read from pretrained weights),
so any layout, any world size, gets the same model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from distrain.models.decoder.moe import MoE, MoEArgs
from distrain.torch_compat import canonical_name


@dataclass(kw_only=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads (plain multi-head)."""
    ffn_dim: int = 512
    max_seq_len: int = 1024
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    pos_emb: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0
    """Llama 3's rotary frequency scaling: 1 = none; else low frequencies are divided by it."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = False
    """Biases in every linear layer and LayerNorm, as GPT-2 has."""
    tie_embeddings: bool = False
    attention_head_dim: int | None = None
    """The width of each attention head; None = dim // n_heads (Qwen3 sets its own)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before the rotary positions (Qwen3)."""
    moe: MoEArgs = field(default_factory=MoEArgs)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """The width of all query heads together (the attention's inner width)."""
        return self.n_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def check(self) -> None:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads "
                f"({self.kv_heads}): each key/value head serves a whole group of query heads"
            )
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")
        self.moe.check(self.n_layers)


def _norm(args: ModelArgs) -> nn.Module:
    if args.norm == "rmsnorm":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    return nn.LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias)


def rope_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The head_dim/2 rotary angular frequencies, with Llama 3's scaling when its factor is not 1.

    Llama 3 keeps high frequencies (wavelength below original_len / high_freq_factor), divides
    low ones (wavelength above original_len / low_freq_factor) by the factor, and blends the band
    between linearly in original_len / wavelength.
    """
    dim = args.head_dim
    freq = 1.0 / args.rope_theta ** (
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    )
    factor = args.rope_scaling_factor
    if factor == 1.0:
        return freq
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    periods_in_context = args.rope_original_max_seq_len * freq / (2 * math.pi)
    blend = ((periods_in_context - low) / (high - low)).clamp(0.0, 1.0)
    return blend * freq + (1 - blend) * freq / factor


def rope_tables(args: ModelArgs, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin tables [seq_len, head_dim/2, 2], computed in fp32 whatever the model's dtype."""
    angles = torch.outer(
        torch.arange(seq_len, device=device, dtype=torch.float32), rope_frequencies(args, device)
    )
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, T, H, D] by position; table is [T, D/2, 2].

    The rotate-half pairing (Hugging Face's Llama) rather than adjacent channels, so Llama
    checkpoints load without permuting the rows of wq and wk.
    """
    first, second = x.float().chunk(2, dim=-1)
    # Contiguous copies (T x D/2 values): multiplying by the table's strided cos/sin views takes
    # a slower elementwise path; the same products, in the same order, either way.
    cos, sin = table[:, None, :, 0].contiguous(), table[:, None, :, 1].contiguous()
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.type_as(x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention over q, k, v [B, H, T, D] holding the whole sequence; with document ids
    `documents` [B, T] a query sees only the keys of its own document (a block-diagonal causal
    mask, an explicit boolean [B, 1, T, T] one)."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    same = documents[:, None, :, None] == documents[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & causal)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.kv_heads * args.head_dim
        # The attention kernel over [B, H, T, D] (and the whole sequence's document ids, when
        # masked by document): a context-parallel layout swaps in one whose sequence spans
        # several ranks (parallel/context.py); the model itself stays plain.
        self.attend = causal_attention
        self.wq = nn.Linear(args.dim, args.q_dim, bias=args.bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.bias)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=args.bias)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None, *, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            # The table may cover more positions than this sequence (see Decoder.forward).
            q, k = apply_rope(q, rope[:seq]), apply_rope(k, rope[:seq])
        group = q.shape[2] // k.shape[2]
        if group > 1:
            # Query head h reads key/value head h // group (also per tp rank: each holds whole
            # groups). Repeated rather than SDPA's enable_gqa, which not every kernel takes.
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.attend(q, k, v) if documents is None else self.attend(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """GELU: w_down(gelu(w_up x)). SwiGLU: w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_gate = (
            nn.Linear(args.dim, args.ffn_dim, bias=args.bias) if args.mlp == "swiglu" else None
        )
        self.w_up = nn.Linear(args.dim, args.ffn_dim, bias=args.bias)
        self.w_down = nn.Linear(args.ffn_dim, args.dim, bias=args.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate is not None:
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
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

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None, *, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, documents=documents)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.mlp_norm(x))


def _moe(args: ModelArgs) -> MoE:
    ffn_dim = args.moe.expert_ffn_dim(args.ffn_dim)
    shared = None
    if args.moe.shared_experts:
        shared = MLP(replace(args, ffn_dim=args.moe.shared_experts * ffn_dim))
    return MoE(args.dim, args.moe, ffn_dim, shared=shared, gated=args.mlp == "swiglu")


class Decoder(nn.Module):
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
        # Computed once for max_seq_len positions, sliced per forward. Not persistent: a
        # function of the config, so no checkpoint holds it; `to_empty` (a meta build's
        # materialization, which leaves buffers uninitialized) computes it again.
        self.register_buffer("rope_cache", None, persistent=False)
        if args.pos_emb == "rope":
            self.rope_cache = rope_tables(args, args.max_seq_len)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Decoder:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        if self.rope_cache is not None:
            with torch.no_grad():
                self.rope_cache.copy_(rope_tables(self.args, self.args.max_seq_len, device="cpu"))
        return self

    def tie_weights(self) -> None:
        """Point the head back at the embedding's weight when tied and both are here (`to_empty`
        calls it). Materializing a plain meta tensor gives each module its own new Parameter,
        which silently unties them; DTensor parameters (FSDP2, tp) are swapped in place and stay
        tied, so there is nothing to do then."""
        if self.args.tie_embeddings and self.tok_emb is not None and self.output is not None:
            if self.output.weight is not self.tok_emb.weight:
                self.output.weight = self.tok_emb.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A pipeline stage may lack the embedding (its input is then hidden states [B, T, D])
        or the head (it then returns hidden states); see spec.py. `positions`
        [T]: the tokens' places in the sequence when they are not 0..T-1 (a context-parallel
        rank holds a few slices of each sequence). `documents` [B, T]: document ids of the
        whole sequence (in sequence order, also when this rank holds only some of its
        positions); attention then stays inside each document. With `targets` [B, T] it
        returns their `summed_next_token_loss` instead of the logits: a model compiled whole
        then has the loss, its softmax and their backward in its one graph too."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds max_seq_len {self.args.max_seq_len}"
            )
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        rope = None
        if self.pos_emb is not None:
            h = h + self.pos_emb(
                torch.arange(seq, device=tokens.device) if positions is None else positions
            )
        elif self.rope_cache is not None:
            if positions is not None:
                rope = self.rope_cache[positions]
            else:
                # A stage fed hidden states may get a sequence shard (sequence parallel within a
                # pipeline): its attention sees the gathered sequence, so it gets the whole table
                # and each attention takes the rows of the length it sees.
                rope = self.rope_cache[:seq] if self.tok_emb is not None else self.rope_cache
        for block in self.blocks.values():
            h = block(h, rope) if documents is None else block(h, rope, documents=documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        return logits if targets is None else summed_next_token_loss(logits, targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against targets [B, T], computed in fp32; negative
    targets (cross_entropy's ignore_index -100) are skipped."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def summed_next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of `next_token_loss`'s per-target terms: training divides it once by the global
    batch's target count, so micro-batches with fewer targets weigh less."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), reduction="sum")


def tied_name(name: str, args: ModelArgs) -> str:
    """`name` canonical, with a tied head named after the embedding it shares: a pipeline's last
    stage holds its own copy of the tied weight as `output.weight` (see parallel/tied.py), which
    must get the embedding's init value and hyperparameters."""
    name = canonical_name(name)
    return "tok_emb.weight" if args.tie_embeddings and name == "output.weight" else name


def param_init_std(name: str, args: ModelArgs) -> float | None:
    """The init of one parameter by name: a normal std, or None for ones (norm weights).

    GPT-2's scheme: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 L);
    biases start at zero.
    """
    if name.endswith(".bias"):
        return 0.0
    if "norm" in name:
        return None
    if name.endswith(
        ("attn.wo.weight", "mlp.w_down.weight", "shared.w_down.weight", "experts.w_down")
    ):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


def full_init_value(name: str, shape: torch.Size, args: ModelArgs, seed: int) -> torch.Tensor:
    """The unsharded fp32 initial value of parameter `name`, from the seed and the name alone."""
    name = tied_name(name, args)
    std = param_init_std(name, args)
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(
    model: nn.Module,
    args: ModelArgs,
    seed: int,
    *,
    source: Callable[[str, torch.Size], torch.Tensor] | None = None,
) -> None:
    """Fill every materialized parameter with its seeded, layout-independent value, or with
    `source(name, full shape)` (pretrained weights) when given; a pipeline stage's copy of a
    tied head reads the embedding it is tied to.

    Values are made on CPU in fp32 as the full tensor; a sharded (DTensor) parameter keeps only
    its own slice of it. So a model initialized on 1 rank or on 8, under any layout, is the same.
    The MoE expert bias (a buffer) starts at zero.
    """
    # Imported here: what only reads a model's sizes (the planner) never imports DTensor
    # (half a second).
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        value = (
            full_init_value(name, param.shape, args, seed)
            if source is None
            else source(tied_name(name, args), param.shape)
        ).to(param.device, param.dtype)
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
