"""The GPT-2 family's Hugging Face adapter: config.json (model_type "gpt2") to and from its
arguments, and its tensors. distrain's linears are [out, in] where GPT-2's Conv1D weights are
[in, out] (transposed both ways), and GPT-2 fuses each attention's query, key and value
projections into one `c_attn` (split on import, concatenated on export)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distrain.models.decoder.model import ModelArgs
from distrain.models.decoder.pretrained import source_from
from distrain.models.hf_files import HfTensor, family_config


def gpt2_model_args(spec: str) -> ModelArgs:
    """The arguments of the GPT-2 checkpoint `hf:DIR`, read from its config.json."""
    _, config = family_config(spec, "gpt2", "gpt2")
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


def hf_tensors(args: ModelArgs) -> list[HfTensor]:
    """Every tensor of the GPT-2 checkpoint of `args`, in a stable order."""
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


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of `args` for transformers' GPT2LMHeadModel (4.x and 5.x read these)."""
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
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def pretrained_source(spec: str, args: ModelArgs) -> Callable[[str, torch.Size], torch.Tensor]:
    """The folder `hf:DIR`'s tensors as the initial weights of `args` (`source_from`)."""
    gpt2_model_args(spec)  # refuses a folder of another model type
    return source_from(spec, args, hf_tensors(args))
