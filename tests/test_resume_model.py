"""A run folder resumed with another model, and a Hugging Face folder that cannot be read, are
refused before any worker starts, in one line; a start that fails leaves the run folder as it
found it; a checkpoint that holds another model is a mismatch, never called corrupt."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from helpers import cli_in_process, run_cli, train_cli, train_in_process

from distrain.errors import CheckpointError, ConfigError

TINY = {
    "training__steps": 2,
    "training__global_batch_size": 4,
    "training__micro_batch_size": 4,
    "training__seq_len": 32,
    "data__max_bytes": 300_000,
}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_another_model_is_refused_before_any_worker_starts(tmp_path):
    run = tmp_path / "kill"
    assert train_cli(run, 1, **TINY).returncode == 0
    before = _files(run)
    args = ["train", "--nproc", "1", "--run.dir", str(run), "--model.preset", "small"]
    refused = run_cli(*args, "--data.max_bytes", "300000")
    assert refused.returncode == ConfigError.exit_code
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("distrain: error: model: this run dir's checkpoint step-00000002")
    assert "holds a gpt 'tiny' model (dim 128" in lines[0]
    assert "the config asks for a gpt 'small' model (dim 384" in lines[0]
    assert f"use another --run-dir, or the run's own config ({run / 'config.toml'})" in lines[0]
    assert "corrupt" not in lines[0] and "delete" not in lines[0]
    assert _files(run) == before  # no rank log, the checkpoint and config.toml byte for byte

    generated = run_cli("generate", "--run-dir", str(run), "--max-new-tokens", "4")
    assert generated.returncode == 0, generated.stderr
    exported = run_cli(
        "export", str(run), "--format", "torch-export", "--out", str(tmp_path / "out.pt2")
    )
    assert exported.returncode == 0, exported.stderr


def test_a_mismatch_reaching_the_loader_is_no_damage_and_the_start_changes_nothing(tmp_path):
    """Past the launcher (the Python API, or a checkpoint whose manifest does not record its
    model), DCP's size mismatch is reported as such, and the failed start puts config.toml
    back."""
    run = tmp_path / "run"
    train_in_process(run, **TINY)
    before = _files(run / "checkpoints")
    config = (run / "config.toml").read_bytes()
    with pytest.raises(CheckpointError) as refused:
        train_in_process(run, **TINY, model__preset="small")
    message = str(refused.value)
    assert "holds another model than the configured one (a mismatch, not damage" in message
    assert "Size mismatch" in message
    assert "corrupt" not in message and "delete" not in message
    assert (run / "config.toml").read_bytes() == config
    assert _files(run / "checkpoints") == before
    assert "model.preset: 'tiny' -> 'small'" in (run / "logs" / "rank0.log").read_text()


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A float32 safetensors file of zero tensors of these shapes."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


def _hf_folder(path: Path) -> Path:
    path.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def _refusal(capsys, run: Path, folder: Path) -> str:
    result = cli_in_process(
        capsys,
        "train",
        "--nproc",
        "1",
        "--run.dir",
        str(run),
        "--model.family",
        "llama",
        "--model.init_from",
        f"hf:{folder}",
    )
    assert result.returncode == ConfigError.exit_code
    assert not run.exists()  # refused before launch: no run folder left behind
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unreadable_hugging_face_folders_are_refused_before_launch(tmp_path, capsys):
    empty = _hf_folder(tmp_path / "empty")
    line = _refusal(capsys, tmp_path / "run", empty)
    assert f"model.init_from: no model.safetensors or model.safetensors.index.json in {empty}" in (
        line
    )

    truncated = _hf_folder(tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    _safetensors(weights, {"model.embed_tokens.weight": [256, 64], "lm_head.weight": [256, 64]})
    weights.write_bytes(weights.read_bytes()[:-1000])
    line = _refusal(capsys, tmp_path / "run", truncated)
    assert f"model.init_from: {weights} is not a complete safetensors file" in line
    assert "declares 131072 bytes of tensors, the file holds 130072" in line
    assert "download it again" in line

    garbled = _hf_folder(tmp_path / "garbled")
    (garbled / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    line = _refusal(capsys, tmp_path / "run", garbled)
    assert "is not a complete safetensors file (its header declares 1099511627776 bytes" in line

    indexed = _hf_folder(tmp_path / "indexed")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (indexed / "model.safetensors.index.json").write_text(json.dumps(index))
    line = _refusal(capsys, tmp_path / "run", indexed)
    assert f"{indexed / 'model-00001-of-00002.safetensors'} is missing" in line
