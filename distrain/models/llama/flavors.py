"""The Llama family's flavors (published shapes, from their Hugging Face configs, and a
CPU-sized one) and the `model.*` fields it reads."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.spec import SHAPE_FIELDS

# What every Llama shares: RMSNorm, SwiGLU, rotary positions, no biases.
_LLAMA = dict(norm="rmsnorm", pos_emb="rope", mlp="swiglu")
_LLAMA3 = dict(
    _LLAMA,
    vocab_size=128256,
    max_seq_len=131072,
    rope_theta=500000.0,
    rope_original_max_seq_len=8192,
)

PRESETS: dict[str, ModelArgs] = {
    "llama-tiny": ModelArgs(
        **{**_LLAMA, "rope_theta": 500000.0},
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=256,
    ),
    # Llama 3.2 1B.
    "llama3-1b": ModelArgs(
        **_LLAMA3,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B.
    "llama3-8b": ModelArgs(
        **_LLAMA3,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_scaling_factor=8.0,
    ),
    "llama2-7b": ModelArgs(
        **_LLAMA,
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=11008,
        max_seq_len=4096,
    ),
}

FIELDS = SHAPE_FIELDS | {"tie_embeddings", "rope_theta", "rope_scaling_factor"}
"""The `model.*` fields a Llama reads: its shape, its head's tying and its rotary base and
scaling. Its norm, MLP and positions are Llama's own."""
