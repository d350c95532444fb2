"""The spec of a family built on the decoder (`decoder_family`): the decoder's module, init,
loss, counts, parallel plans and pipeline cut, with the family's own flavors, the `model.*`
fields it reads, its reading of a Hugging Face config.json and its Hugging Face adapter.

A pipeline stage keeps a range of `blocks`, the first stage the embeddings, the last the final
norm and the head (Decoder.forward treats a missing one as a cut); activation checkpointing,
per-block compile and FSDP2 wrap each block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

from torch import nn

from distrain.family.spec import HfAdapter, ModelShape, ModelSpec
from distrain.models.decoder.args import decoder_args
from distrain.models.decoder.counts import flops_per_token, num_params, routed_expert_params
from distrain.models.decoder.model import Decoder, ModelArgs, init_weights, summed_next_token_loss
from distrain.models.decoder.moe import MoEArgs, moe_layers

SHAPE_FIELDS = frozenset(
    {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"}
)
"""The `model.*` fields every family on the decoder reads: its sizes."""

MOE_FIELDS = frozenset(
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
)
"""The `model.moe.*` fields: the mixture-of-experts layers' settings."""


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
        top_k=args.moe.top_k if args.moe.enabled else 0,
        expert_params=routed_expert_params(args),
        kv_width=args.kv_heads * args.head_dim,
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


def _tensor_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """parallelize.tensor_plan, imported when a layout with tp needs it: torch's tensor-parallel
    styles import DTensor (half a second), which the planner, reading sizes only, never needs."""
    from distrain.models.decoder.parallelize import tensor_plan

    return tensor_plan(model, sequence_parallel)


def decoder_family(
    name: str,
    *,
    presets: Mapping[str, ModelArgs],
    fields: frozenset[str],
    from_hf: Callable[[str], ModelArgs] | None,
    hf: HfAdapter | None,
) -> ModelSpec:
    """The spec of the family `name` on the decoder: its flavors (`presets`), the `model.*`
    fields it reads, its reading of a Hugging Face config.json (`from_hf`; None: it imports
    none) and its Hugging Face adapter (None: it has no Hugging Face equivalent)."""
    return ModelSpec(
        name=name,
        presets=presets,
        config_fields=fields,
        args_from_config=partial(decoder_args, presets=presets, from_hf=from_hf),
        shape=_shape,
        num_params=num_params,
        flops_per_token=flops_per_token,
        describe=_describe,
        build=Decoder,
        init_weights=init_weights,
        loss=summed_next_token_loss,
        blocks="blocks",
        first_stage=("tok_emb", "pos_emb"),
        last_stage=("norm", "output"),
        tensor_plan=_tensor_plan,
        attention_modules=_attention_modules,
        loss_in_forward=True,
        tied_weights=_tied_weights,
        embeddings=("tok_emb.weight", "pos_emb.weight"),
        moe_layers=moe_layers,
        moe_settings=_moe_settings,
        hf=hf,
    )
