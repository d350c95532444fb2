"""The GPT family's flavors (named presets, from the CPU default to multi-billion sizes for
planning, and published models' shapes) and its arguments from the `[model]` section."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from distrain.config.schema import ConfigError, ModelConfig
from distrain.models.gpt.hf import hf_model_args
from distrain.models.gpt.model import ModelArgs
from distrain.models.moe import MoEArgs

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


# model.<field> -> the ModelArgs field it sets, where the names differ.
ARGUMENT_OF = {"head_dim": "attention_head_dim"}


def decoder_args(
    cfg: ModelConfig, presets: Mapping[str, ModelArgs], from_hf: Callable[[str], ModelArgs]
) -> ModelArgs:
    """The preset of `presets` named by cfg.preset (or the Hugging Face folder of
    cfg.init_from, read by `from_hf`) with cfg's non-None fields applied over it (a sequence
    longer than its max_seq_len is refused by layout/rules.py, never silently allowed for).
    The family's `config_fields` decide which fields may be set (models/registry.py)."""
    if cfg.init_from:
        base = from_hf(cfg.init_from)
    elif cfg.preset not in presets:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.preset!r} of model.family {cfg.family!r}; "
            f"choose one of {', '.join(presets)}"
        )
    else:
        base = presets[cfg.preset]
    overrides = {
        ARGUMENT_OF.get(f.name, f.name): getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in ("family", "preset", "init_from", "moe")
        and getattr(cfg, f.name) is not None
    }
    moe = {
        f.name: getattr(cfg.moe, f.name)
        for f in dataclasses.fields(cfg.moe)
        if getattr(cfg.moe, f.name) is not None
    }
    overrides["moe"] = dataclasses.replace(base.moe, **moe)
    args = dataclasses.replace(base, **overrides)
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e
    return args


def gpt_args(cfg: ModelConfig) -> ModelArgs:
    """The GPT family's arguments from the [model] section (`decoder_args`)."""
    return decoder_args(cfg, PRESETS, hf_model_args)
