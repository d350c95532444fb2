"""The GPT family (and its mixture-of-experts variant) as the rest of distrain sees it:
`GPT_SPEC`, registered under "gpt" (models/registry.py).

The model is model.py's; its tensor-parallel plan parallelize.py's; its Hugging Face adapter
hf.py's; its flavors flavors.py's; its counts counts.py's. A pipeline stage keeps a range of
`blocks`, the first stage the embeddings, the last the final norm and the head (GPT.forward
treats a missing one as a cut); activation checkpointing, per-block compile and FSDP2 wrap each
block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial

from torch import nn

from distrain.family.spec import HfAdapter, ModelShape, ModelSpec
from distrain.models.gpt.counts import flops_per_token, num_params
from distrain.models.gpt.flavors import PRESETS, decoder_args, gpt_args
from distrain.models.gpt.hf import hf_config, hf_tensors, pretrained_source
from distrain.models.gpt.model import GPT, ModelArgs, init_weights, summed_next_token_loss
from distrain.models.gpt.parallelize import tensor_plan
from distrain.models.moe import MoEArgs, moe_layers

_FIELDS = frozenset(
    {
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "ffn_dim",
        "max_seq_len",
        "norm",
        "pos_emb",
        "tie_embeddings",
        "n_kv_heads",
        "mlp",
        "bias",
        "rope_theta",
        "rope_scaling_factor",
    }
    | {
        f"moe.{name}"
        for name in (
            "num_experts",
            "top_k",
            "every",
            "shared_experts",
            "ffn_dim",
            "capacity_factor",
            "aux_loss_coef",
            "z_loss_coef",
            "balance",
            "bias_update_rate",
        )
    }
)


def _shape(args: ModelArgs) -> ModelShape:
    return ModelShape(
        vocab_size=args.vocab_size,
        max_seq_len=args.max_seq_len,
        dim=args.dim,
        n_layers=args.n_layers,
        tp_split=(
            ("n_heads", args.n_heads),
            ("ffn_dim", args.ffn_dim),
            ("vocab_size", args.vocab_size),
            ("dim", args.dim),
            ("n_kv_heads", args.kv_heads),
        ),
        num_experts=args.moe.num_experts,
        moe_layers=tuple(i for i in range(args.n_layers) if args.moe.is_moe_layer(i)),
    )


def _describe(args: ModelArgs) -> str:
    moe = args.moe
    experts = f", {moe.num_experts} experts top-{moe.top_k}" if moe.enabled else ""
    width = f" of {args.head_dim}" if args.attention_head_dim else ""
    qk_norm = ", qk-norm" if args.qk_norm else ""
    return (
        f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads{width} "
        f"({args.kv_heads} kv){qk_norm}, ffn {args.ffn_dim}, vocab {args.vocab_size}, "
        f"{args.mlp}{experts}"
    )


def _tied_weights(model: nn.Module) -> tuple[str, str] | None:
    return ("tok_emb.weight", "output.weight") if model.args.tie_embeddings else None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [block.attn for block in model.blocks.values()]


def _moe_settings(args: ModelArgs) -> MoEArgs | None:
    return args.moe if args.moe.enabled else None


GPT_SPEC = ModelSpec(
    name="gpt",
    presets=PRESETS,
    config_fields=_FIELDS,
    args_from_config=gpt_args,
    shape=_shape,
    num_params=num_params,
    flops_per_token=flops_per_token,
    describe=_describe,
    build=GPT,
    init_weights=init_weights,
    loss=summed_next_token_loss,
    blocks="blocks",
    first_stage=("tok_emb", "pos_emb"),
    last_stage=("norm", "output"),
    tensor_plan=tensor_plan,
    attention_modules=_attention_modules,
    loss_in_forward=True,
    tied_weights=_tied_weights,
    embeddings=("tok_emb.weight", "pos_emb.weight"),
    moe_layers=moe_layers,
    moe_settings=_moe_settings,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)


def decoder_family(
    name: str,
    *,
    presets: Mapping[str, ModelArgs],
    fields: frozenset[str],
    from_hf: Callable[[str], ModelArgs],
    hf: HfAdapter,
) -> ModelSpec:
    """The spec of a family built on this decoder (Qwen3, Mixtral): the GPT's module, parallel
    plans, pipeline cut and init, with the family's own flavors, the `model.*` fields it reads,
    its reading of a Hugging Face config.json (`from_hf`) and its Hugging Face adapter."""
    return dataclasses.replace(
        GPT_SPEC,
        name=name,
        presets=presets,
        config_fields=fields,
        args_from_config=partial(decoder_args, presets=presets, from_hf=from_hf),
        hf=hf,
    )
