"""`distrain export`: a run's checkpoint as a Hugging Face model folder, a PEFT adapter folder (a
LoRA run's) or a torch.export program. A LoRA run (lora.rank > 0) exports its base weights, made
again from model.init_from (or the seed), with its adapters merged (hf), or its adapters alone
(peft).

The Hugging Face export streams: it reads the checkpoint's metadata (names, shapes), writes each
safetensors shard's header from it, then loads tensors from the DCP checkpoint (whatever layout
saved it: DCP reassembles the shards) a few at a time, up to READ_BATCH_BYTES, or one when it is
larger, and appends their bytes. DCP reads a tensor and then copies it into place, so peak memory
is about twice the largest tensor or batch, never the whole model. Output: config.json,
generation_config.json, model-0000K-of-0000N.safetensors shards, their index, and the run's
tokenizer files when it used a Hugging Face tokenizer.

The torch.export program is the eager model traced with a dynamic batch and sequence length;
`torch.export.load(path).module()(tokens)` gives the logits.
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from distrain.checkpoint.checkpointer import read_checkpoints_of
from distrain.checkpoint.load import _safe_reader, load
from distrain.checkpoint.manifest import Entry, committed, verify
from distrain.checkpoint.storage import Storage
from distrain.config.io import load_config, run_config_file
from distrain.config.schema import Config, DataConfig, LoRAConfig, ModelConfig
from distrain.data.tokenizer import HF_FILE, HFTokenizer, hf_tokenizer_dir, load_tokenizer
from distrain.errors import CheckpointError, ConfigError
from distrain.files import copy_file
from distrain.launch.rundir import run_id
from distrain.models.hf_files import INDEX_FILE, HfTensor
from distrain.models.registry import (
    build_model,
    family_name,
    model_args,
    model_family,
    model_shape,
)
from distrain.observe.logs import LOGGER_NAME as LOGGER
from distrain.parallel.lora import apply_lora, base_source, init_lora, merge_lora, peft_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_SHARD_MB = 2048
READ_BATCH_BYTES = 64 * 2**20
MODEL_KEY = "model"  # the model's part of a training checkpoint (train/loop.py's state)
# The files of a Hugging Face tokenizer folder that transformers reads (save_pretrained writes
# the chat template to chat_template.jinja, not into tokenizer_config.json).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _run_config(run_dir: Path, checkpoint_dir: str | None) -> tuple[Config, Storage]:
    """The config of the run in `run_dir` and the storage its checkpoints are read from."""
    cfg = load_config(str(run_config_file(run_dir)))
    return cfg, read_checkpoints_of(cfg.checkpoint, run_dir, checkpoint_dir)


def _checkpoint(storage: Storage, run_dir: Path, step: int | None) -> Entry:
    """The newest committed checkpoint in `storage` of the run in `run_dir` (or the one of
    `step`), verified against its manifest."""
    own = run_id(run_dir, create=False)
    entries = [e for e in committed(storage) if e.manifest.get("run_id") == own]
    if step is not None:
        entries = [e for e in entries if e.step == step]
    if not entries:
        which = f"at step {step}" if step is not None else "complete"
        raise CheckpointError(f"export: no {which} checkpoint under {storage.url}")
    entry = entries[-1]
    problem = verify(storage, entry)
    if problem is not None:
        raise CheckpointError(
            f"export: checkpoint {storage.url_of(entry.path)} is damaged: {problem}"
        )
    return entry


def _quiet_load(storage: Storage, entry: Entry, state: dict[str, Any]) -> None:
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: intended
        warnings.simplefilter("ignore", UserWarning)
        load(storage, entry.path, state, partial=True)


def _header(specs: list[tuple[HfTensor, list[int]]], dtype: torch.dtype) -> bytes:
    """A safetensors header for tensors of these shapes, written in this order."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec, shape in specs:
        size = dtype.itemsize
        for dim in shape:
            size *= dim
        entries[spec.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _hf_shape(spec: HfTensor, shapes: dict[str, list[int]]) -> list[int]:
    parts = [shapes[name] for name in spec.names]
    if spec.kind == "same":
        return parts[0]
    if spec.kind == "transpose":
        return parts[0][::-1]
    if spec.kind == "expert":
        return parts[0][1:][::-1]
    rows = sum(p[0] for p in parts)
    return [rows] if len(parts[0]) == 1 else [parts[0][1], rows]


def _plan_shards(
    specs: list[HfTensor], shapes: dict[str, list[int]], dtype: torch.dtype, limit_bytes: float
) -> list[list[tuple[HfTensor, list[int]]]]:
    """The tensors of each output file, in order, each file at most `limit_bytes` (or one
    tensor larger than that)."""
    shards: list[list[tuple[HfTensor, list[int]]]] = [[]]
    shard_bytes = 0
    for spec in specs:
        shape = _hf_shape(spec, shapes)
        size = dtype.itemsize * int(torch.Size(shape).numel())
        if shards[-1] and shard_bytes + size > limit_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((spec, shape))
        shard_bytes += size
    return shards


def _read_groups(specs: list[HfTensor], shapes: dict[str, list[int]]) -> list[list[HfTensor]]:
    """Consecutive tensors read by one DCP load, up to READ_BATCH_BYTES (a larger tensor alone):
    each load costs a metadata read and a plan (~0.1 s), too much to pay per norm weight."""
    groups: list[list[HfTensor]] = [[]]
    group_bytes = 0
    held: set[str] = set()  # names the group reads already (experts share their stacked weight)
    for spec in specs:
        new = [n for n in spec.names if n not in held]
        size = 4 * sum(int(torch.Size(shapes[n]).numel()) for n in new)
        if groups[-1] and size and group_bytes + size > READ_BATCH_BYTES:
            groups.append([])
            group_bytes, held = 0, set()
            new = list(spec.names)
        groups[-1].append(spec)
        group_bytes += size
        held.update(new)
    return groups


def _write_tensor(out: BinaryIO, tensor: torch.Tensor) -> None:
    out.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)


def export_hf(
    run_dir: Path,
    out_dir: Path,
    *,
    step: int | None = None,
    dtype: str = "fp32",
    shard_mb: float = DEFAULT_SHARD_MB,
    checkpoint_dir: str | None = None,
) -> Path:
    """Write the run's checkpoint as a Hugging Face model folder; returns `out_dir`."""
    cfg, storage = _run_config(run_dir, checkpoint_dir)
    family = model_family(family_name(cfg.model))
    if family.hf is None:
        raise ConfigError(
            f"export: the {family.name!r} model family has no Hugging Face equivalent; "
            "export a torch.export program instead (--format torch-export)"
        )
    args = model_args(cfg.model)
    torch_dtype = DTYPES[dtype]
    if cfg.lora.rank:  # the adapters merged into the base weights
        out_dir.mkdir(parents=True, exist_ok=True)
        _export_merged(
            cfg.model,
            cfg.lora,
            cfg.training.seed,
            storage,
            run_dir,
            out_dir,
            step=step,
            dtype=torch_dtype,
        )
        return _finish_hf(cfg.data, family, args, out_dir, torch_dtype)
    specs = family.hf.tensors(args)
    entry = _checkpoint(storage, run_dir, step)
    metadata = _safe_reader(storage, entry.path).read_metadata()
    prefix = MODEL_KEY + "."
    shapes = {
        key[len(prefix) :]: list(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(meta, "size")
    }
    missing = [n for s in specs for n in s.names if n not in shapes]
    if missing:
        raise CheckpointError(f"export: checkpoint {entry.path} lacks model tensors {missing[:3]}")
    out_dir.mkdir(parents=True, exist_ok=True)

    shards = _plan_shards(specs, shapes, torch_dtype, shard_mb * 2**20)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        with open(out_dir / name, "wb") as f:
            f.write(_header(shard, torch_dtype))
            for group in _read_groups([spec for spec, _ in shard], shapes):
                tensors = {n: torch.empty(shapes[n]) for spec in group for n in spec.names}
                _quiet_load(storage, entry, {MODEL_KEY: tensors})
                for spec in group:
                    value = spec.to_hf([tensors[n] for n in spec.names]).to(torch_dtype)
                    _write_tensor(f, value)
                    total += value.nbytes
                    weight_map[spec.hf_name] = name
    (out_dir / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return _finish_hf(cfg.data, family, args, out_dir, torch_dtype)


def _finish_hf(
    data: DataConfig, family: Any, args: Any, out_dir: Path, torch_dtype: torch.dtype
) -> Path:
    """config.json, generation_config.json and the tokenizer's files of an hf export."""
    (out_dir / "config.json").write_text(
        json.dumps(family.hf.config(args, dtype=torch_dtype), indent=2)
    )
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(data), indent=2))
    _copy_tokenizer(data, out_dir)
    return out_dir


def _tokenizer_spec(data: DataConfig) -> str:
    """The run's tokenizer setting; runs from before `data.tokenizer` existed used bytes."""
    return str(getattr(data, "tokenizer", "bytes"))


def _generation_config(data: DataConfig) -> dict[str, Any]:
    """Sampling defaults; token ids come from the tokenizer, which the byte tokenizer lacks."""
    config: dict[str, Any] = {"do_sample": True, "temperature": 0.8, "top_k": 50}
    spec = _tokenizer_spec(data)
    folder = hf_tokenizer_dir(spec)
    if folder is not None:
        tokenizer_config = folder / "tokenizer_config.json"
        if tokenizer_config.is_file():
            known = json.loads(tokenizer_config.read_text())
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if known.get(key) is not None:
                    config[key] = known[key]
    return config


def _copy_tokenizer(data: DataConfig, out_dir: Path) -> None:
    """A Hugging Face tokenizer's files go with the weights (`hf:DIR`, or `hf:FILE` for one
    tokenizer.json); byte and tiktoken tokenizers have no transformers files to copy. A lone
    tokenizer.json gets a tokenizer_config.json naming the generic fast tokenizer, so that
    AutoTokenizer encodes exactly as the tokenizer.json does (the model type's own tokenizer
    class would add its special tokens)."""
    spec = _tokenizer_spec(data)
    tokenizer = load_tokenizer(spec)
    if not isinstance(tokenizer, HFTokenizer):
        return
    # The files by their names in the folder (tokenizer.file is resolved): each must be a
    # regular file, not a link, which could point at a secret (copy_file refuses it).
    named = Path(spec.partition(":")[2]).expanduser()
    source = named / HF_FILE if named.is_dir() else tokenizer.file
    copy_file(source, out_dir / HF_FILE)
    if source.name == HF_FILE:  # in a tokenizer folder: its other files too
        for name in TOKENIZER_FILES:
            if name != HF_FILE and (source.parent / name).is_file():
                copy_file(source.parent / name, out_dir / name)
    if not (out_dir / "tokenizer_config.json").is_file():
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
        )


def load_run_model(
    run_dir: Path, *, step: int | None = None, checkpoint_dir: str | None = None
) -> tuple[nn.Module, int]:
    """The run's model on CPU in fp32 at its newest (or `step`'s) checkpoint, and the step (a
    LoRA run's with its adapters merged into the base weights)."""
    cfg, storage = _run_config(run_dir, checkpoint_dir)
    model, step_ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run_dir, step)
    return (merge_lora(model) if cfg.lora.rank else model), step_


def _model_at(
    model_cfg: ModelConfig,
    lora: LoRAConfig,
    seed: int,
    storage: Storage,
    run_dir: Path,
    step: int | None,
) -> tuple[nn.Module, int]:
    """The model of `model_cfg` at the run's newest (or `step`'s) checkpoint in `storage`. A LoRA
    run's checkpoint holds only its adapters: its base weights are made again as training made
    them (model.init_from, or the init seeded with training.seed `seed`), its adapters
    (`LoRALinear`s) loaded."""
    entry = _checkpoint(storage, run_dir, step)
    model = build_model(model_cfg)
    if lora.rank:
        family, args = model_family(family_name(model_cfg)), model_args(model_cfg)
        apply_lora(model, family, args, lora)
        model.to_empty(device="cpu")
        source = None
        if model_cfg.init_from:
            assert family.hf is not None
            source = base_source(family.hf.source(model_cfg.init_from, args))
        family.init_weights(model, args, seed, source=source)
        init_lora(model, seed)
        state = {MODEL_KEY: {n: p.data for n, p in model.named_parameters() if p.requires_grad}}
        _quiet_load(storage, entry, state)
        model.load_state_dict(state[MODEL_KEY], strict=False)
    else:
        model.to_empty(device="cpu")
        state = {MODEL_KEY: model.state_dict()}
        _quiet_load(storage, entry, state)
        model.load_state_dict(state[MODEL_KEY])
    logging.getLogger(LOGGER).info("export: loaded %s", entry.path)
    return model.eval(), entry.step


def export_peft(
    run_dir: Path, out_dir: Path, *, step: int | None = None, checkpoint_dir: str | None = None
) -> Path:
    """Write a LoRA run's adapters as a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors under peft's key names), which
    `peft.PeftModel.from_pretrained(<the model.init_from model>, out_dir)` loads; returns
    `out_dir`."""
    cfg, storage = _run_config(run_dir, checkpoint_dir)
    if not cfg.lora.rank:
        raise ConfigError(
            "export --format peft: the run trained every weight (lora.rank = 0); export it "
            "with --format hf"
        )
    family = model_family(family_name(cfg.model))
    if family.hf is None:
        raise ConfigError(f"export: the {family.name!r} model family has no Hugging Face names")
    args = model_args(cfg.model)
    model, _ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run_dir, step)
    tensors, targets, fan_in_fan_out = peft_tensors(model, family, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    base = cfg.model.init_from
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base[len("hf:") :] if base.startswith("hf:") else None,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": targets,
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _export_merged(
    model_cfg: ModelConfig,
    lora: LoRAConfig,
    seed: int,
    storage: Storage,
    run_dir: Path,
    out_dir: Path,
    **how: Any,
) -> None:
    """A LoRA run's model (`model_cfg` with `lora`'s adapters, initialised from `seed` as the
    run was), adapters merged, as the safetensors file and index of a Hugging Face folder (the
    model in memory: a fine-tuned one fits)."""
    family = model_family(family_name(model_cfg))
    assert family.hf is not None
    model, _ = _model_at(model_cfg, lora, seed, storage, run_dir, how["step"])
    state = {k: v.detach() for k, v in merge_lora(model).state_dict().items()}
    specs = family.hf.tensors(model_args(model_cfg))
    shapes = {n: list(state[n].shape) for s in specs for n in s.names}
    ((shard,),) = [_plan_shards(specs, shapes, how["dtype"], float("inf"))]
    name = "model-00001-of-00001.safetensors"
    total = 0
    with open(out_dir / name, "wb") as f:
        f.write(_header(shard, how["dtype"]))
        for spec, _ in shard:
            value = spec.to_hf([state[n] for n in spec.names]).to(how["dtype"])
            _write_tensor(f, value)
            total += value.nbytes
    weight_map = {spec.hf_name: name for spec, _ in shard}
    (out_dir / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def export_program(
    run_dir: Path, out_file: Path, *, step: int | None = None, checkpoint_dir: str | None = None
) -> Path:
    """Write a torch.export program of the run's model (token ids [B, T] -> logits [B, T, V])
    with dynamic batch size and sequence length up to max_seq_len; returns `out_file`."""
    model, _ = load_run_model(run_dir, step=step, checkpoint_dir=checkpoint_dir)
    cfg, _ = _run_config(run_dir, checkpoint_dir)
    max_seq_len = model_shape(cfg.model).max_seq_len
    seq = min(max_seq_len, 8)
    example = torch.zeros(2, seq, dtype=torch.long)
    dims = {
        0: torch.export.Dim("batch", min=1, max=1024),
        1: torch.export.Dim("seq", min=1, max=max_seq_len),
    }
    program = torch.export.export(model, (example,), dynamic_shapes={"tokens": dims})
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(out_file))
    return out_file
