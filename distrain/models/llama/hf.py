"""The Llama family's Hugging Face adapter: config.json (model_type "llama") to and from its
arguments, and its tensors. distrain's linears are [out, in] as Llama's are, and its rotary
layout is Llama's rotate-half one, so only names differ: no transpose, no row permutation of the
query and key weights in either direction. Qwen3's and Mixtral's adapters start from these
(they are Llama's names and config keys plus their own)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distrain.errors import ConfigError
from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.pretrained import source_from
from distrain.models.hf_files import HfTensor, family_config


def llama_model_args(spec: str) -> ModelArgs:
    """The arguments of the Llama checkpoint `hf:DIR`, read from its config.json."""
    path, config = family_config(spec, "llama", "llama")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // heads):
        raise ConfigError(
            f"model.init_from: {path} has head_dim {config['head_dim']} != hidden_size / heads; "
            "a Llama's heads are hidden_size / num_attention_heads wide"
        )
    return llama_like_args(config, path)


def llama_like_args(config: dict[str, Any], path: Path, **fixed: Any) -> ModelArgs:
    """The arguments of a Llama-shaped config.json (Llama's, Qwen3's), with `fixed` set."""
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"model.init_from: {path} uses hidden_act {config['hidden_act']!r}")
    if config.get("attention_bias", False) != config.get("mlp_bias", False):
        raise ConfigError(
            f"model.init_from: {path} has biases in attention or MLP only; distrain's "
            "model.bias puts them in both"
        )
    # transformers 5 keeps rotary settings in rope_parameters; 4.x in rope_scaling + rope_theta.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    args = ModelArgs(
        vocab_size=config["vocab_size"],
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        ffn_dim=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        norm="rmsnorm",
        norm_eps=config.get("rms_norm_eps", 1e-6),
        pos_emb="rope",
        rope_theta=float(theta),
        mlp="swiglu",
        bias=bool(config.get("attention_bias", False)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **fixed,
    )
    if rope_type == "llama3":
        return ModelArgs(
            **{
                **vars(args),
                "rope_scaling_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_max_seq_len": int(rope["original_max_position_embeddings"]),
            }
        )
    if rope_type != "default":
        raise ConfigError(
            f"model.init_from: {path} uses rope type {rope_type!r}; distrain supports the "
            "default and 'llama3' rotary scalings"
        )
    return args


def hf_tensors(args: ModelArgs) -> list[HfTensor]:
    """Every tensor of the Llama checkpoint of `args`, in a stable order (Qwen3's too: with
    `qk_norm`, each attention's q_norm and k_norm; Mixtral's but its MoE blocks' experts)."""
    out = [HfTensor("model.embed_tokens.weight", ("tok_emb.weight",))]
    linears = {
        "self_attn.q_proj": "attn.wq",
        "self_attn.k_proj": "attn.wk",
        "self_attn.v_proj": "attn.wv",
        "self_attn.o_proj": "attn.wo",
        "mlp.gate_proj": "mlp.w_gate",
        "mlp.up_proj": "mlp.w_up",
        "mlp.down_proj": "mlp.w_down",
    }
    for i in range(args.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out.append(HfTensor(hf + "input_layernorm.weight", (ours + "attn_norm.weight",)))
        out.append(HfTensor(hf + "post_attention_layernorm.weight", (ours + "mlp_norm.weight",)))
        if args.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out.append(HfTensor(f"{hf}self_attn.{norm}.weight", (f"{ours}attn.{norm}.weight",)))
        for hf_linear, linear in linears.items():
            if linear.startswith("mlp.") and args.moe.is_moe_layer(i):
                continue  # the block's experts (Mixtral's, models/mixtral/hf.py) stand in for it
            out.append(HfTensor(f"{hf}{hf_linear}.weight", (f"{ours}{linear}.weight",)))
            if args.bias:
                out.append(HfTensor(f"{hf}{hf_linear}.bias", (f"{ours}{linear}.bias",)))
    out.append(HfTensor("model.norm.weight", ("norm.weight",)))
    if not args.tie_embeddings:
        out.append(HfTensor("lm_head.weight", ("output.weight",)))
    return out


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """Llama's config.json keys for `args` (Qwen3's start from them)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "attention_bias": args.bias,
        "mlp_bias": args.bias,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return config


def pretrained_source(spec: str, args: ModelArgs) -> Callable[[str, torch.Size], torch.Tensor]:
    """The folder `hf:DIR`'s tensors as the initial weights of `args` (`source_from`)."""
    llama_model_args(spec)  # refuses a folder of another model type
    return source_from(spec, args, hf_tensors(args))
