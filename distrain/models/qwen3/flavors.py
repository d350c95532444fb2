"""The Qwen3 family's flavors (published dense shapes, from their Hugging Face configs, and a
CPU-sized one) and the `model.*` fields it reads."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs

# What every Qwen3 shares: RMSNorm (eps 1e-6) on the residual stream and on each query and key
# head, SwiGLU, rotary positions at base 1e6, no biases, 128-wide heads.
_QWEN3 = dict(
    vocab_size=151936,
    max_seq_len=40960,
    norm="rmsnorm",
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    mlp="swiglu",
    qk_norm=True,
    attention_head_dim=128,
)

PRESETS: dict[str, ModelArgs] = {
    # Heads wider than dim / n_heads, as in every Qwen3 (0.6B: 16 heads of 128 on a 1024 stream).
    "qwen3-tiny": ModelArgs(
        **{**_QWEN3, "vocab_size": 256, "max_seq_len": 256, "attention_head_dim": 32},
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        tie_embeddings=True,
    ),
    "qwen3-0.6b": ModelArgs(
        **_QWEN3,
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=3072,
        tie_embeddings=True,
    ),  # fmt: skip
    "qwen3-1.7b": ModelArgs(
        **_QWEN3,
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=6144,
        tie_embeddings=True,
    ),  # fmt: skip
    "qwen3-8b": ModelArgs(
        **_QWEN3,
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=12288,
    ),  # fmt: skip
}

FIELDS = frozenset(
    {
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "ffn_dim",
        "max_seq_len",
        "tie_embeddings",
        "rope_theta",
    }
)
"""The `model.*` fields a Qwen3 reads: its shape. Its norm, MLP, positions and biases are
Qwen3's own."""
