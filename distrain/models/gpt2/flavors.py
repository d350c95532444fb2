"""The GPT-2 family's flavors (the published shapes, GPT-2 124M with its vocabulary padded to
a multiple of 64 for GPUs, and a CPU-sized one) and the `model.*` fields it reads."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs

# What every GPT-2 shares: LayerNorm with biases, learned positions, GELU, biases in every
# linear, the head tied to the token embedding, plain multi-head attention.
_GPT2 = dict(
    norm="layernorm",
    pos_emb="learned",
    mlp="gelu",
    bias=True,
    tie_embeddings=True,
)
_PUBLISHED = dict(_GPT2, vocab_size=50257, max_seq_len=1024)

PRESETS: dict[str, ModelArgs] = {
    "gpt2-tiny": ModelArgs(
        **_GPT2, vocab_size=256, max_seq_len=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256
    ),
    "gpt2": ModelArgs(**_PUBLISHED, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "gpt2-medium": ModelArgs(**_PUBLISHED, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # GPT-2 124M with its vocabulary padded from 50257 to 50304 (a multiple of 64).
    "gpt2-124m": ModelArgs(
        **_GPT2,
        vocab_size=50304,
        max_seq_len=1024,
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=3072,
    ),  # fmt: skip
}

FIELDS = frozenset({"vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"})
"""The `model.*` fields a GPT-2 reads: its shape. Its norm, MLP, positions, biases and tied
head are GPT-2's own, and its heads are all key/value heads."""
