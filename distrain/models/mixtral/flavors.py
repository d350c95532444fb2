"""The Mixtral family's flavors (the published 8x7B shape and a CPU-sized one) and the `model.*`
fields it reads."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.moe import MoEArgs

# What every Mixtral shares: Llama's attention and norms, rotary base 1e6, no biases, and in
# every block top-2 routing over 8 SwiGLU experts (gates renormalised, no capacity limit).
_MIXTRAL = dict(
    vocab_size=32000,
    max_seq_len=32768,
    norm="rmsnorm",
    rope_theta=1_000_000.0,
    mlp="swiglu",
)


def _experts(num_experts: int = 8) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=2, aux_loss_coef=0.02)


PRESETS: dict[str, ModelArgs] = {
    "mixtral-tiny": ModelArgs(
        **{**_MIXTRAL, "vocab_size": 256, "max_seq_len": 256},
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        moe=_experts(4),
    ),
    "mixtral-8x7b": ModelArgs(
        **_MIXTRAL,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        moe=_experts(),
    ),  # fmt: skip
}

FIELDS = frozenset(
    {
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "max_seq_len",
        "tie_embeddings",
        "rope_theta",
        "moe.num_experts",
        "moe.top_k",
        "moe.aux_loss_coef",
        "moe.z_loss_coef",
        "moe.balance",
        "moe.bias_update_rate",
        "moe.capacity_factor",
    }
)
"""The `model.*` fields a Mixtral reads: its shape and its routing (every block holds experts of
model.ffn_dim; no shared experts)."""
