"""The residual MLP family as distrain sees it: its flavors, the `model.*` fields it reads, its
counts and `SPEC` (the entry point `residual_mlp = "distrain_residual_mlp.spec:SPEC"`)."""

from __future__ import annotations

import dataclasses

from distrain.config.schema import ModelConfig
from distrain.errors import ConfigError
from distrain.family.spec import ModelShape, ModelSpec
from distrain_residual_mlp.model import ResidualMLPArgs, ResidualMLPLM, init_weights, loss
from distrain_residual_mlp.parallelize import tensor_plan

PRESETS = {
    "rmlp-tiny": ResidualMLPArgs(),
    "rmlp-wide": ResidualMLPArgs(dim=128, hidden=512, n_layers=6),
}

# model.<field> -> the argument it sets.
FIELDS = {
    "vocab_size": "vocab_size",
    "dim": "dim",
    "ffn_dim": "hidden",
    "n_layers": "n_layers",
    "max_seq_len": "max_seq_len",
}


def args_from_config(cfg: ModelConfig) -> ResidualMLPArgs:
    if cfg.preset not in PRESETS:
        raise ConfigError(
            f"model.preset: the residual_mlp family has no preset {cfg.preset!r}; choose one "
            f"of {', '.join(PRESETS)}"
        )
    if cfg.init_from:
        raise ConfigError("model.init_from: the residual_mlp family reads no pretrained weights")
    set_ = {arg: getattr(cfg, f) for f, arg in FIELDS.items() if getattr(cfg, f) is not None}
    return dataclasses.replace(PRESETS[cfg.preset], **set_)


def shape(args: ResidualMLPArgs) -> ModelShape:
    return ModelShape(
        vocab_size=args.vocab_size,
        max_seq_len=args.max_seq_len,
        dim=args.dim,
        n_layers=args.n_layers,
        tp_split=(("vocab_size", args.vocab_size), ("ffn_dim", args.hidden)),
    )


def num_params(args: ResidualMLPArgs) -> int:
    norm = 2 * args.dim
    block = norm + (args.dim + 1) * args.hidden + (args.hidden + 1) * args.dim
    return 2 * args.vocab_size * args.dim + args.n_layers * block + norm


def flops_per_token(args: ResidualMLPArgs, seq_len: int) -> float:
    """6 per matmul weight (the head and the MLPs; the embedding is a lookup)."""
    return 6 * (args.vocab_size * args.dim + args.n_layers * 2 * args.dim * args.hidden)


def describe(args: ResidualMLPArgs) -> str:
    return f"dim {args.dim}, {args.n_layers} layers, hidden {args.hidden}, vocab {args.vocab_size}"


SPEC = ModelSpec(
    name="residual_mlp",
    presets=PRESETS,
    config_fields=frozenset(FIELDS),
    args_from_config=args_from_config,
    shape=shape,
    num_params=num_params,
    flops_per_token=flops_per_token,
    describe=describe,
    build=ResidualMLPLM,
    init_weights=init_weights,
    loss=loss,
    blocks="layers",
    first_stage=("embed",),
    last_stage=("ln_f", "unembed"),
    tensor_plan=tensor_plan,
    sequence_parallel=False,
    embeddings=("embed.weight",),
)
