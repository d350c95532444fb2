"""Hugging Face checkpoint folders, whatever the model: the `hf:DIR` spelling, the files a
folder holds (config.json, safetensors files and their index), and `HfTensor`, how one Hugging Face
tensor is made of a family's tensors. A family's own mapping (names, config.json keys) lives with
the family (distrain/models/llama/hf.py for Llama's mapping, gpt2/hf.py for GPT-2's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from distrain.errors import ConfigError, MissingInput, install_hint
from distrain.files import plain_file_name

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# How an HF tensor is made of distrain tensors: the same tensor, its transpose, (GPT-2's fused
# c_attn) the transpose of wq, wk and wv stacked along the output dimension, or (Mixtral's
# experts) the transpose of one expert's slice of a stacked expert weight.
Kind = Literal["same", "transpose", "fused_qkv", "expert"]


@dataclass(frozen=True)
class HfTensor:
    hf_name: str
    names: tuple[str, ...]
    kind: Kind = "same"
    expert: int = 0
    """With kind "expert": which expert's slice of the stacked [experts, in, out] distrain
    parameter this [out, in] tensor is (Mixtral's per-expert linears)."""

    def to_hf(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "same":
            return tensors[0]
        if self.kind == "transpose":
            return tensors[0].t()
        if self.kind == "expert":
            return tensors[0][self.expert].t()
        return torch.cat(tensors, dim=0).t()

    def from_hf(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """The distrain tensors in `names` order; `sizes` are their first dimensions. An
        expert's tensor gives its slice of the stacked parameter (the reader stacks them)."""
        if self.kind == "same":
            return [tensor]
        if self.kind in ("transpose", "expert"):
            return [tensor.t()]
        if tensor.ndim == 1:  # the fused bias
            return list(tensor.split(sizes))
        return [t.t() for t in tensor.split(sizes, dim=1)]


def hf_dir(spec: str) -> Path:
    """The folder of a `model.init_from = "hf:DIR"` value, checked to hold a config.json."""
    if not spec.startswith(HF_PREFIX):
        raise ConfigError(
            f"model.init_from = {spec!r}: expected 'hf:DIR' (a local Hugging Face checkpoint)"
        )
    path = Path(spec[len(HF_PREFIX) :]).expanduser()
    if not (path / CONFIG_FILE).is_file():
        raise MissingInput(
            f"model.init_from: no {CONFIG_FILE} in {path}; point it at a folder written by "
            "save_pretrained (or by distrain export --format hf)"
        )
    return path


def family_config(spec: str, model_type: str, family: str) -> tuple[Path, dict[str, Any]]:
    """(folder, config.json) of `model.init_from = spec` for the model family `family`, which
    imports Hugging Face's `model_type`; a folder of another model type is refused in one line."""
    path = hf_dir(spec)
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("model_type") != model_type:
        raise ConfigError(
            f"model.init_from: {path / CONFIG_FILE} has model_type "
            f"{config.get('model_type')!r}; model.family = {family!r} imports {model_type!r} "
            "(`distrain presets` lists the families)"
        )
    return path, config


def safe_open() -> Any:
    """safetensors' reader; imported on use, as only `model.init_from` needs the package."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ConfigError(
            "model.init_from needs the safetensors package: " + install_hint("safetensors", "hf")
        ) from e
    return safe_open


def weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"model.init_from: {index} is not a safetensors index ({type(e).__name__})"
            ) from e
        # A folder is data: its index may only name files inside it.
        outside = sorted({f for f in files.values() if not plain_file_name(f)})
        if outside:
            raise ConfigError(
                f"model.init_from: {index} names {outside[0][:100]!r}, not a file in {path}"
            )
        return {name: path / file for name, file in files.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise ConfigError(
            f"model.init_from: no {SINGLE_FILE} or {INDEX_FILE} in {path} (only safetensors "
            "checkpoints are read: they cannot run code)"
        )
    with safe_open()(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
