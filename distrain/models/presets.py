"""Named model presets, from the CPU default to multi-billion sizes for planning, and an exact
parameter count that needs no model instance (so a 70B plan costs nothing to compute)."""

from __future__ import annotations

import dataclasses

from distrain.config import ConfigError, ModelConfig
from distrain.models.gpt import ModelArgs

PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, ffn_dim=512, max_seq_len=1024
    ),
    "small": ModelArgs(
        vocab_size=256, dim=384, n_layers=6, n_heads=6, ffn_dim=1536, max_seq_len=1024
    ),
    "gpt2-124m": ModelArgs(
        vocab_size=50304,
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=3072,
        max_seq_len=1024,
        norm="layernorm",
        pos_emb="learned",
        tie_embeddings=True,
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
}


def model_args(cfg: ModelConfig) -> ModelArgs:
    """The preset named by cfg.preset with cfg's non-None fields applied over it (a sequence
    longer than its max_seq_len is refused by layout.py, never silently allowed for)."""
    if cfg.preset not in PRESETS:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}"
        )
    overrides = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name != "preset" and getattr(cfg, f.name) is not None
    }
    args = dataclasses.replace(PRESETS[cfg.preset], **overrides)
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e
    return args


def num_params(args: ModelArgs) -> int:
    """Exact parameter count of GPT(args), counting a tied embedding once."""
    norm = args.dim  # RMSNorm and bias-free LayerNorm: one weight vector each
    block = 4 * args.dim * args.dim + 2 * args.dim * args.ffn_dim + 2 * norm
    total = args.vocab_size * args.dim + args.n_layers * block + norm
    if args.pos_emb == "learned":
        total += args.max_seq_len * args.dim
    if not args.tie_embeddings:
        total += args.vocab_size * args.dim
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: 6 per matmul weight plus attention's
    12 L T d (PaLM's accounting). Embedding lookups are not matmuls; the output projection is."""
    lookups = args.max_seq_len * args.dim if args.pos_emb == "learned" else 0
    if not args.tie_embeddings:
        lookups += args.vocab_size * args.dim
    return 6 * (num_params(args) - lookups) + 12 * args.n_layers * seq_len * args.dim
