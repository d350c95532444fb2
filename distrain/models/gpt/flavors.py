"""The gpt family's flavors (named presets, from the CPU default to multi-billion sizes for
planning, dense or with mixture-of-experts layers) and the `model.*` fields it reads: every
setting of the shared decoder (norm, positions, MLP, biases, experts), so a shape no published
model has can be tried. Published models' shapes are their own families' (llama, gpt2, qwen3,
mixtral), which read and write Hugging Face folders; this one has no Hugging Face equivalent."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.moe import MoEArgs
from distrain.models.decoder.spec import MOE_FIELDS, SHAPE_FIELDS

PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, ffn_dim=512, max_seq_len=1024
    ),
    "small": ModelArgs(
        vocab_size=256, dim=384, n_layers=6, n_heads=6, ffn_dim=1536, max_seq_len=1024
    ),
    "1b": ModelArgs(
        vocab_size=32000, dim=2048, n_layers=18, n_heads=16, ffn_dim=8192, max_seq_len=2048
    ),
    "7b": ModelArgs(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=16384, max_seq_len=4096
    ),
    "13b": ModelArgs(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=20480, max_seq_len=4096
    ),
    # tiny's shape with 8 experts of half tiny's MLP width, 2 per token: the same active
    # parameters per token as tiny (plus the router).
    "moe-tiny": ModelArgs(
        vocab_size=256,
        dim=128,
        n_layers=4,
        n_heads=4,
        ffn_dim=512,
        max_seq_len=1024,
        moe=MoEArgs(num_experts=8, top_k=2, ffn_dim=256, aux_loss_coef=0.01),
    ),
    # Switch Transformer's routing at tiny's shape: 8 experts of tiny's MLP width, 1 per token,
    # capacity factor 1.25 (tokens over it pass through the residual).
    "switch-tiny": ModelArgs(
        vocab_size=256,
        dim=128,
        n_layers=4,
        n_heads=4,
        ffn_dim=512,
        max_seq_len=1024,
        moe=MoEArgs(num_experts=8, top_k=1, capacity_factor=1.25, aux_loss_coef=0.01),
    ),
}


FIELDS = (
    SHAPE_FIELDS
    | {"norm", "pos_emb", "tie_embeddings", "mlp", "bias", "rope_theta", "rope_scaling_factor"}
    | MOE_FIELDS
)
"""The `model.*` fields the gpt family reads: all of the decoder's."""
