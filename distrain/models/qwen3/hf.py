"""The Qwen3 family's Hugging Face adapter: config.json (model_type "qwen3") to and from its
arguments; its tensors are Llama's names plus each attention's q_norm and k_norm
(models/llama/hf.py's), read as the initial weights by `pretrained_source`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distrain.errors import ConfigError
from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.pretrained import source_from
from distrain.models.hf_files import HfTensor, family_config
from distrain.models.llama.hf import hf_config as llama_config
from distrain.models.llama.hf import hf_tensors as llama_tensors
from distrain.models.llama.hf import llama_like_args


def qwen3_model_args(spec: str) -> ModelArgs:
    """The arguments of the Qwen3 checkpoint `hf:DIR`, read from its config.json."""
    path, config = family_config(spec, "qwen3", "qwen3")
    if config.get("use_sliding_window"):
        raise ConfigError(f"model.init_from: {path} uses sliding-window attention")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return llama_like_args(config, path, qk_norm=True, attention_head_dim=head_dim)


def hf_tensors(args: ModelArgs) -> list[HfTensor]:
    return llama_tensors(args)


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of `args` for transformers' Qwen3ForCausalLM."""
    config = llama_config(args, dtype=dtype)
    config.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        use_sliding_window=False,
        sliding_window=None,
    )
    config.pop("mlp_bias")
    return config


def pretrained_source(spec: str, args: ModelArgs) -> Callable[[str, torch.Size], torch.Tensor]:
    qwen3_model_args(spec)  # refuses a folder of another model type
    return source_from(spec, args, hf_tensors(args))
