"""Named model presets, from the CPU default to multi-billion sizes for planning, and an exact
parameter count that needs no model instance (so a 70B plan costs nothing to compute)."""

from __future__ import annotations

import dataclasses

from distrain.config import ConfigError, ModelConfig
from distrain.models.gpt import ModelArgs

_GPT2 = dict(
    vocab_size=50257,
    max_seq_len=1024,
    norm="layernorm",
    pos_emb="learned",
    mlp="gelu",
    bias=True,
    tie_embeddings=True,
)
_LLAMA3 = dict(
    vocab_size=128256,
    max_seq_len=131072,
    rope_theta=500000.0,
    rope_original_max_seq_len=8192,
    mlp="swiglu",
)

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
    # Published models' shapes (Hugging Face configs), and small members of each family.
    "gpt2": ModelArgs(**_GPT2, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "gpt2-medium": ModelArgs(**_GPT2, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    "gpt2-tiny": ModelArgs(
        **{**_GPT2, "vocab_size": 256, "max_seq_len": 256},
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_dim=256,
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
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=11008,
        max_seq_len=4096,
        mlp="swiglu",
    ),
    "llama-tiny": ModelArgs(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=256,
        mlp="swiglu",
        rope_theta=500000.0,
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
    if cfg.init_from:
        # The checkpoint's own config.json is the shape (interop sits above models: imported
        # here, on use, to keep the module order).
        from distrain.interop.hf import hf_model_args

        base = hf_model_args(cfg.init_from)
    elif cfg.preset not in PRESETS:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}"
        )
    else:
        base = PRESETS[cfg.preset]
    overrides = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in ("preset", "init_from") and getattr(cfg, f.name) is not None
    }
    args = dataclasses.replace(base, **overrides)
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e
    return args


def num_params(args: ModelArgs) -> int:
    """Exact parameter count of GPT(args), counting a tied embedding once."""
    bias = args.bias
    # RMSNorm: a weight vector; LayerNorm: also a bias vector when the model has biases.
    norm = args.dim * (2 if bias and args.norm == "layernorm" else 1)
    kv_dim = args.kv_heads * args.head_dim
    attn = 2 * args.dim * (args.dim + kv_dim) + bias * (2 * args.dim + 2 * kv_dim)
    matrices = 3 if args.mlp == "swiglu" else 2
    mlp = matrices * args.dim * args.ffn_dim + bias * ((matrices - 1) * args.ffn_dim + args.dim)
    block = attn + mlp + 2 * norm
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
