"""Checkpoint protocol in one process: commit by manifest, verification and fallback, retention,
async saves, safe loading, and a full disk. Multi-rank saves are covered in test_training.py."""

import errno
import json
import logging
import pickle

import pytest
import torch

from distrain import checkpoint
from distrain.checkpoint import Checkpointer, committed
from distrain.storage import Storage

# Not under "distrain": setup_logging turns that logger's propagation off, hiding it from caplog.
LOG = logging.getLogger("distrain_test.checkpoint")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "step": torch.tensor(0)}


def _checkpointer(tmp_path, *, keep: int = 2, async_mode: bool = False) -> Checkpointer:
    return Checkpointer(
        Storage(str(tmp_path)),
        layout="test",
        async_mode=async_mode,
        keep_temporary=keep,
        logger=LOG,
    )


def _restored(ckpt: Checkpointer) -> tuple[int | None, float]:
    target = _state(0.0)
    step = ckpt.restore_latest(target)
    return step, float(target["model"]["w"][0, 0])


def test_round_trip_and_manifest(tmp_path):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(3, _state(1.5), permanent=False)
    assert _restored(ckpt) == (3, 1.5)
    manifest = json.loads((tmp_path / "step-00000003" / "MANIFEST.json").read_text())
    assert manifest["step"] == 3 and manifest["kind"] == "temporary"
    assert manifest["world_size"] == 1 and manifest["layout"] == "test"
    assert {"distrain_version", "torch_version"} <= manifest.keys()
    assert ".metadata" in manifest["files"]
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())


def test_save_torn_before_manifest_is_ignored(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(checkpoint, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, _state(2.0), permanent=False)
    assert (tmp_path / "step-00000002" / ".metadata").exists()  # data there, never committed
    assert [e.step for e in committed(ckpt.storage)] == [1]
    assert _restored(_checkpointer(tmp_path)) == (1, 1.0)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-10]), "bytes, manifest says"),  # truncated
        (
            lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]),
            "fails its SHA-256 checksum",
        ),  # one flipped bit, same size
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["truncated", "bitflip", "missing"],
)
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage, reason):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    damage(next((tmp_path / "step-00000002").glob("*.distcp")))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _restored(_checkpointer(tmp_path)) == (1, 1.0)
    assert "step-00000002 is damaged" in caplog.text and reason in caplog.text


def test_nothing_intact_restores_nothing(tmp_path):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    next((tmp_path / "step-00000001").glob("*.distcp")).write_bytes(b"junk")
    assert _restored(_checkpointer(tmp_path))[0] is None


def test_retention_keeps_newest_temporary_and_every_permanent(tmp_path):
    ckpt = _checkpointer(tmp_path, keep=2)
    for step in range(1, 8):
        ckpt.save(step, _state(float(step)), permanent=step in (2, 5))
    kept = [(e.step, e.permanent) for e in committed(ckpt.storage)]
    assert kept == [(2, True), (5, True), (6, False), (7, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002",
        "step-00000005",
        "step-00000006",
        "step-00000007",
    ]


def test_full_disk_leaves_earlier_checkpoints_intact(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path, keep=1)
    ckpt.save(1, _state(1.0), permanent=False)
    real_writer = ckpt.storage.dcp_writer

    def full_disk_writer(path):
        writer = real_writer(path)

        def no_space(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        writer.write_data = no_space
        return writer

    monkeypatch.setattr(ckpt.storage, "dcp_writer", full_disk_writer)
    ckpt.save(2, _state(2.0), permanent=False)  # logged, not raised: training may go on
    assert [e.step for e in committed(ckpt.storage)] == [1]
    assert _restored(_checkpointer(tmp_path)) == (1, 1.0)


def test_async_save_commits_after_wait(tmp_path):
    ckpt = _checkpointer(tmp_path, async_mode=True)
    state = _state(3.0)
    ckpt.save(4, state, permanent=False)
    state["model"]["w"].fill_(99.0)  # training goes on: the save holds its own copy
    ckpt.wait()
    assert _restored(_checkpointer(tmp_path)) == (4, 3.0)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_metadata_cannot_run_code(tmp_path, capsys):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    path = tmp_path / "step-00000001"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(checkpoint.CheckpointError, match="builtins.print, which is not allowed"):
        checkpoint.load(ckpt.storage, str(path), _state(0.0))
    assert "pwned" not in capsys.readouterr().out
