"""The Mixtral family's Hugging Face adapter: config.json (model_type "mixtral") to and from its
arguments, and its tensors: Llama's attention and norms (models/llama/hf.py's) and,
per block, the router (`block_sparse_moe.gate`) and each expert's three linears (w1: gate, w3:
up, w2: down), which distrain holds stacked over the experts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distrain.errors import ConfigError
from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.moe import MoEArgs
from distrain.models.decoder.pretrained import source_from
from distrain.models.hf_files import HfTensor, family_config
from distrain.models.llama.hf import hf_config as llama_config
from distrain.models.llama.hf import hf_tensors as llama_tensors
from distrain.models.llama.hf import llama_like_args

# Mixtral's expert linears -> distrain's stacked expert weights.
_EXPERT_WEIGHTS = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}


def mixtral_model_args(spec: str) -> ModelArgs:
    """The arguments of the Mixtral checkpoint `hf:DIR`, read from its config.json."""
    path, config = family_config(spec, "mixtral", "mixtral")
    if config.get("sliding_window") is not None:
        raise ConfigError(f"model.init_from: {path} uses sliding-window attention")
    head_dim = config.get("head_dim")
    if head_dim not in (None, config["hidden_size"] // config["num_attention_heads"]):
        raise ConfigError(f"model.init_from: {path} has heads of another width than its stream")
    moe = MoEArgs(
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.02)),
    )
    return llama_like_args(config, path, moe=moe)


def hf_tensors(args: ModelArgs) -> list[HfTensor]:
    out = []
    for t in llama_tensors(args):
        out.append(t)
        if t.hf_name.endswith("post_attention_layernorm.weight"):
            out += _moe_tensors(args, int(t.hf_name.split(".")[2]))
    return out


def _moe_tensors(args: ModelArgs, layer: int) -> list[HfTensor]:
    hf, ours = f"model.layers.{layer}.block_sparse_moe.", f"blocks.{layer}.moe."
    out = [HfTensor(hf + "gate.weight", (ours + "router.weight",))]
    for e in range(args.moe.num_experts):
        for linear, weight in _EXPERT_WEIGHTS.items():
            name = f"{hf}experts.{e}.{linear}.weight"
            out.append(HfTensor(name, (f"{ours}experts.{weight}",), "expert", expert=e))
    return out


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of `args` for transformers' MixtralForCausalLM."""
    config = llama_config(args, dtype=dtype)
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=args.moe.num_experts,
        num_experts_per_tok=args.moe.top_k,
        router_aux_loss_coef=args.moe.aux_loss_coef,
        sliding_window=None,
    )
    for key in ("mlp_bias", "attention_bias", "rope_scaling"):
        config.pop(key)
    return config


def pretrained_source(spec: str, args: ModelArgs) -> Callable[[str, torch.Size], torch.Tensor]:
    mixtral_model_args(spec)  # refuses a folder of another model type
    return source_from(spec, args, hf_tensors(args))
