"""The GPT family's Hugging Face adapter: the mapping between distrain's GPT and transformers'
Llama and GPT-2.

This module owns three translations, all offline (local files only):
- a Hugging Face `config.json` <-> `ModelArgs` (`hf_model_args`, `hf_config`);
- parameter names and layouts (`hf_tensors`): distrain's linears are [out, in]; GPT-2's Conv1D
  weights are [in, out] and its query/key/value projections one fused `c_attn`; Llama's names
  differ only. distrain's rotary layout is Llama's rotate-half one, so no row permutation of the
  query and key weights is needed in either direction;
- a local checkpoint as the initial weights (`pretrained_source`, used by `model.init_from`):
  each rank reads a tensor from the safetensors files when its parameter is initialized, and
  keeps its own slice of it, as seeded init does, so it works under every layout.
Reading a checkpoint folder, whatever the model, is models/hf_files.py's; writing a whole export
from a
run's checkpoint is interop/export.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from distrain.errors import ConfigError
from distrain.models.gpt.model import ModelArgs
from distrain.models.hf_files import CONFIG_FILE, HfTensor, hf_dir, safe_open, weight_files


def family(args: ModelArgs) -> Literal["llama", "gpt2"]:
    """Which transformers architecture holds `args`, or a one-line refusal naming what differs."""
    if args.qk_norm:
        raise ConfigError(
            "this model normalizes its query and key heads, which Llama and GPT-2 do not; "
            "train it as model.family = 'qwen3'"
        )
    if args.moe.enabled:
        raise ConfigError(
            "this model has experts, which Llama and GPT-2 do not; for a Hugging Face "
            "mixture of experts train it as model.family = 'mixtral'"
        )
    if args.pos_emb == "rope" and args.norm == "rmsnorm" and args.mlp == "swiglu":
        return "llama"
    gpt2 = (
        args.pos_emb == "learned"
        and args.norm == "layernorm"
        and args.mlp == "gelu"
        and args.bias
        and args.tie_embeddings
        and args.kv_heads == args.n_heads
    )
    if gpt2:
        return "gpt2"
    raise ConfigError(
        "this model has no Hugging Face equivalent: Llama needs model.pos_emb = 'rope', "
        "norm = 'rmsnorm', mlp = 'swiglu'; GPT-2 needs pos_emb = 'learned', norm = 'layernorm', "
        "mlp = 'gelu', bias = true, tie_embeddings = true and no n_kv_heads "
        "(see the llama-* and gpt2-* presets)"
    )


def hf_tensors(args: ModelArgs) -> list[HfTensor]:
    """Every tensor of the Hugging Face checkpoint of `args`, in a stable order."""
    if family(args) == "gpt2":
        return _gpt2_tensors(args)
    return llama_tensors(args)


def llama_tensors(args: ModelArgs) -> list[HfTensor]:
    """Llama's tensor names (Qwen3's too: with `qk_norm`, each attention's q_norm and
    k_norm; Mixtral's but the experts of its MoE blocks)."""
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


def _gpt2_tensors(args: ModelArgs) -> list[HfTensor]:
    out = [
        HfTensor("transformer.wte.weight", ("tok_emb.weight",)),
        HfTensor("transformer.wpe.weight", ("pos_emb.weight",)),
    ]
    for i in range(args.n_layers):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = tuple(f"{ours}attn.{w}" for w in ("wq", "wk", "wv"))
        for suffix in ("weight", "bias"):
            out += [
                HfTensor(f"{hf}ln_1.{suffix}", (f"{ours}attn_norm.{suffix}",)),
                HfTensor(f"{hf}ln_2.{suffix}", (f"{ours}mlp_norm.{suffix}",)),
            ]
        out += [
            HfTensor(hf + "attn.c_attn.weight", tuple(n + ".weight" for n in qkv), "fused_qkv"),
            HfTensor(hf + "attn.c_attn.bias", tuple(n + ".bias" for n in qkv), "fused_qkv"),
            HfTensor(hf + "attn.c_proj.weight", (ours + "attn.wo.weight",), "transpose"),
            HfTensor(hf + "attn.c_proj.bias", (ours + "attn.wo.bias",)),
            HfTensor(hf + "mlp.c_fc.weight", (ours + "mlp.w_up.weight",), "transpose"),
            HfTensor(hf + "mlp.c_fc.bias", (ours + "mlp.w_up.bias",)),
            HfTensor(hf + "mlp.c_proj.weight", (ours + "mlp.w_down.weight",), "transpose"),
            HfTensor(hf + "mlp.c_proj.bias", (ours + "mlp.w_down.bias",)),
        ]
    out += [
        HfTensor("transformer.ln_f.weight", ("norm.weight",)),
        HfTensor("transformer.ln_f.bias", ("norm.bias",)),
    ]
    return out


# --- config.json ------------------------------------------------------------------------------


def hf_model_args(spec: str) -> ModelArgs:
    """The distrain shape of the checkpoint `hf:DIR`, read from its config.json."""
    path = hf_dir(spec)
    config = json.loads((path / CONFIG_FILE).read_text())
    model_type = config.get("model_type")
    if model_type == "llama":
        return _llama_args(config, path)
    if model_type == "gpt2":
        return _gpt2_args(config)
    raise ConfigError(
        f"model.init_from: {path / CONFIG_FILE} has model_type {model_type!r}; model.family = "
        "'gpt' imports 'llama' and 'gpt2' (see `distrain presets` for the other families)"
    )


def _llama_args(config: dict[str, Any], path: Path) -> ModelArgs:
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // heads):
        raise ConfigError(
            f"model.init_from: {path} has head_dim {config['head_dim']} != hidden_size / heads; "
            "the gpt family's heads are hidden_size / num_attention_heads wide"
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


def _gpt2_args(config: dict[str, Any]) -> ModelArgs:
    dim = config["n_embd"]
    return ModelArgs(
        vocab_size=config["vocab_size"],
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        ffn_dim=config.get("n_inner") or 4 * dim,
        max_seq_len=config["n_positions"],
        norm="layernorm",
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        pos_emb="learned",
        mlp="gelu",
        bias=True,
        tie_embeddings=True,
    )


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of `args` for transformers (4.x and 5.x both read these keys)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if family(args) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": args.vocab_size,
            "n_positions": args.max_seq_len,
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": args.ffn_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": args.norm_eps,
            "tie_word_embeddings": True,
            "torch_dtype": dtype_name,
        }
    return llama_config(args, dtype=dtype)


def llama_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
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


# --- import -----------------------------------------------------------------------------------


def pretrained_source(spec: str, args: ModelArgs) -> Callable[[str, torch.Size], torch.Tensor]:
    """`name, shape -> full fp32 value` of each distrain parameter, read from `hf:DIR` (for
    `init_weights`). Shapes are checked, so a model override that changes them is refused."""
    return source_from(spec, args, hf_tensors(args))


def source_from(
    spec: str, args: ModelArgs, tensors: list[HfTensor]
) -> Callable[[str, torch.Size], torch.Tensor]:
    """`pretrained_source` over the Hugging Face tensors `tensors` of `args`."""
    open_file = safe_open()
    path = hf_dir(spec)
    files = weight_files(path)
    by_name: dict[str, list[HfTensor]] = {}
    for t in tensors:
        for name in t.names:
            by_name.setdefault(name, []).append(t)
    kv_dim = args.kv_heads * args.head_dim

    def part(spec_: HfTensor, name: str) -> torch.Tensor:
        if spec_.hf_name not in files:
            raise ConfigError(
                f"model.init_from: {path} has no tensor {spec_.hf_name!r} for {name}"
            )
        with open_file(files[spec_.hf_name], framework="pt") as f:
            tensor = f.get_tensor(spec_.hf_name).float()
        parts = spec_.from_hf(tensor, [args.q_dim, kv_dim, kv_dim])
        return parts[spec_.names.index(name)]

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        specs = by_name.get(name)
        if not specs:
            raise ConfigError(f"model.init_from: no tensor of {path} maps to {name}")
        if specs[0].kind == "expert":  # one tensor per expert, stacked in expert order
            result = torch.stack([part(s, name) for s in sorted(specs, key=lambda s: s.expert)])
        else:
            result = part(specs[0], name)
        if result.shape != shape:
            raise ConfigError(
                f"model.init_from: {specs[0].hf_name} in {path} has shape {tuple(result.shape)}, "
                f"the model's {name} {tuple(shape)}; remove model overrides that change shapes"
            )
        return result.contiguous()

    return value
