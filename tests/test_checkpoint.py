"""Checkpoint commit protocol and safe loading (single process; multi-rank in test_training)."""

import pickle

import pytest
import torch

from distrain import checkpoint
from distrain.errors import CheckpointError


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "trainer": {"step": torch.tensor(0)}}


def test_save_load_round_trip(tmp_path):
    checkpoint.save(tmp_path, 3, _state(1.5), world_size=1)
    target = _state(0.0)
    checkpoint.load(checkpoint.step_dir(tmp_path, 3), target)
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 1.5))


def test_uncommitted_checkpoint_is_ignored(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, _state(1.0), world_size=1)

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed before the marker")

    monkeypatch.setattr(checkpoint, "write_marker", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, _state(2.0), world_size=1)
    assert (checkpoint.step_dir(tmp_path, 2) / ".metadata").exists()  # data is there, uncommitted
    assert checkpoint.latest_checkpoint(tmp_path) == (1, checkpoint.step_dir(tmp_path, 1))
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.load(checkpoint.step_dir(tmp_path, 2), _state(0.0))


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = checkpoint.save(tmp_path, 1, _state(1.0), world_size=1)
    data_file = next(path.glob("*.distcp"))
    data_file.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="is corrupt or unreadable"):
        checkpoint.load(path, _state(0.0))


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_metadata_cannot_run_code(tmp_path, capsys):
    path = checkpoint.save(tmp_path, 1, _state(1.0), world_size=1)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="builtins.print, which is not allowed"):
        checkpoint.load(path, _state(0.0))
    assert "pwned" not in capsys.readouterr().out
