"""The GPT family (and its mixture-of-experts variant) as the parallel mechanisms see it:
`GPT_SPEC`, registered under "gpt" (models/registry.py).

The model is model.py's; its tensor-parallel plan parallelize.py's; its Hugging Face adapter
hf.py's. A pipeline stage keeps a range of `blocks`, the first stage the embeddings, the last the
final norm and the head (GPT.forward treats a missing one as a cut); activation checkpointing,
per-block compile and FSDP2 wrap each block.
"""

from __future__ import annotations

from torch import nn

from distrain.models.gpt.hf import pretrained_source
from distrain.models.gpt.model import GPT, ModelArgs, init_weights, summed_next_token_loss
from distrain.models.gpt.parallelize import tensor_plan
from distrain.models.moe import MoEArgs, moe_layers
from distrain.parallel.spec import ModelSpec


def _tied_weights(model: nn.Module) -> tuple[str, str] | None:
    return ("tok_emb.weight", "output.weight") if model.args.tie_embeddings else None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [block.attn for block in model.blocks.values()]


def _moe_settings(args: ModelArgs) -> MoEArgs | None:
    return args.moe if args.moe.enabled else None


GPT_SPEC = ModelSpec(
    name="gpt",
    args_type=ModelArgs,
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
    moe_layers=moe_layers,
    moe_settings=_moe_settings,
    pretrained_source=pretrained_source,
)
