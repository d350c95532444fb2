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
    index = _index(path)
    if index is not None:
        return index
    single = _single_file(path)
    with safe_open()(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (safetensors' own limit): a larger length is damage."""


def check_weights(path: Path) -> None:
    """The launcher's check of a `model.init_from` folder, before any worker starts: it holds
    weights (model.safetensors, or an index naming files that are there), each file's header
    parses, names the tensors the index gives it, and declares exactly the file's size (a
    truncated download is refused). Only the headers are read, never the tensors."""
    index = _index(path)
    if index is None:
        files = {_single_file(path): set[str]()}
    else:
        files = {}
        for name, file in index.items():
            files.setdefault(file, set()).add(name)
    for file, names in sorted(files.items()):
        where = f"model.init_from: {file}"
        if not file.is_file():
            raise ConfigError(
                f"{where} is missing ({path / INDEX_FILE} names it); download the folder again"
            )
        problem = header_problem(file)
        if problem is None:
            missing = names - set(read_header(file)[0])
            if missing:
                problem = f"lacks the tensor {sorted(missing)[0][:100]!r} that the index names"
        if problem is not None:
            raise ConfigError(
                f"{where} is not a complete safetensors file ({problem}); download it again, "
                "or export the folder again"
            )


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), from its
    header: 8 bytes of little-endian length, then that many bytes of JSON; and the number of
    bytes after the header. Raises ValueError naming what is wrong."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than a header")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"its header declares {length} bytes, the file has {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    return header, size - 8 - length


def header_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file, or None: its header is unreadable, or its
    tensors' data_offsets do not cover exactly the bytes after the header."""
    try:
        header, data = read_header(file)
    except (OSError, ValueError) as e:  # json's errors are ValueErrors
        return str(e).splitlines()[0][:200] if isinstance(e, ValueError) else e.strerror
    end = 0
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"tensor {str(name)[:100]!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if data != end:
        return f"its header declares {end} bytes of tensors, the file holds {data}"
    return None


def _index(path: Path) -> dict[str, Path] | None:
    """HF tensor name -> file, from the folder's safetensors index; None without one."""
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
    return None


def _single_file(path: Path) -> Path:
    """The folder's model.safetensors, which a folder without an index must hold."""
    single = path / SINGLE_FILE
    if not single.is_file():
        raise ConfigError(
            f"model.init_from: no {SINGLE_FILE} or {INDEX_FILE} in {path} (only safetensors "
            "checkpoints are read: they cannot run code); point it at a folder with its weights"
        )
    return single
