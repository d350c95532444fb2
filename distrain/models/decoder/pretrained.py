"""A family's Hugging Face tensors as the decoder's initial weights (`source_from`, for
`model.init_from`): each rank reads a tensor from the safetensors files when its parameter is
initialized and keeps its own slice of it, as seeded init does, so it works under every layout.
Which tensors a family's folder holds, and how each is made of the decoder's parameters, is the
family's adapter's (its `HfTensor` list)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distrain.errors import ConfigError
from distrain.models.decoder.model import ModelArgs
from distrain.models.hf_files import HfTensor, hf_dir, safe_open, weight_files


def source_from(
    spec: str, args: ModelArgs, tensors: list[HfTensor]
) -> Callable[[str, torch.Size], torch.Tensor]:
    """`name, shape -> full fp32 value` of each decoder parameter, read from the Hugging Face
    tensors `tensors` of `args` in the folder `hf:DIR`. Shapes are checked, so a model override
    that changes them is refused."""
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
            raise ConfigError(f"model.init_from: {path} has no tensor {spec_.hf_name!r} for {name}")
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
