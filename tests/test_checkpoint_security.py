"""A checkpoint is data, never code: hostile `.metadata` files (each with its hash rewritten in
the manifest, as whoever can write the folder would), hostile manifests, and retention that must
never lose the only good checkpoint. Each attack must fail: no code runs (a marker file), the
refusal is one line naming the file and the forbidden thing, resume falls back."""

from __future__ import annotations

import copyreg
import hashlib
import json
import logging
import pickle
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from helpers import cli_in_process, train_in_process
from torch.distributed.checkpoint import metadata as dcp_metadata

from distrain.checkpoint import manifest
from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.load import load
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.metadata import ALLOWED, decode_metadata
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError, ConfigError
from distrain.inference.generate import load_model
from distrain.interop.export import load_run_model

LOG = logging.getLogger("distrain_test.checkpoint_security")
FS = "torch.distributed.checkpoint.filesystem"


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((8, 8), value)}, "step": torch.tensor(0)}


def _checkpointer(root: Path, *, keep: int = 2, run_id: str = "run-a") -> Checkpointer:
    return Checkpointer(
        Storage(str(root)),
        run_id=run_id,
        layout="test",
        async_mode="off",
        keep_temporary=keep,
        logger=LOG,
    )


# --- pickle bytes built by hand, opcode by opcode ------------------------------------------------


def _unicode(text: str) -> bytes:  # SHORT_BINUNICODE / BINUNICODE
    data = text.encode()
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data
    return b"X" + struct.pack("<I", len(data)) + data


def _global_line(module: str, name: str) -> bytes:  # GLOBAL: protocols 0-3
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _stack_global(module: str, name: str) -> bytes:  # STACK_GLOBAL: protocols 4-5
    return _unicode(module) + _unicode(name) + b"\x93"


def _call(proto: int, target: bytes, *args: str) -> bytes:
    """`target(*args)` as a pickle of protocol `proto` (REDUCE)."""
    header = b"" if proto < 2 else b"\x80" + bytes([proto])
    if proto == 0:
        return header + target + b"(" + b"".join(b"V" + a.encode() + b"\n" for a in args) + b"tR."
    return header + target + b"(" + b"".join(_unicode(a) for a in args) + b"tR."


def _hostile(marker: Path, out: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (the .metadata bytes, what the refusal must name)."""
    touch = f"touch {marker}"
    dotted = (FS, "os.system")
    return {
        # Dotted names under each protocol: `os.system` reached through an allowed-looking module.
        "dotted_p0": (_call(0, _global_line(*dotted), touch), "os.system"),
        "dotted_p2": (_call(2, _global_line(*dotted), touch), "os.system"),
        "dotted_p4": (_call(4, _stack_global(*dotted), touch), "os.system"),
        "dotted_p5": (_call(5, _stack_global(*dotted), touch), "os.system"),
        # Functions inside torch.distributed.checkpoint.*: this one writes a file of our choice.
        "dcp_function": (
            _call(
                4,
                _stack_global("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save"),
                str(out.parent),
                str(marker),
            ),
            "dcp_to_torch_save",
        ),
        # Builtins reached by attribute chains from allowed names and modules.
        "chain_from_class": (
            _call(4, _stack_global(dcp_metadata.__name__, "Metadata.__init__"), touch),
            "Metadata.__init__",
        ),
        "chain_from_module": (_call(4, _stack_global("pathlib", "os.system"), touch), "os.system"),
        "builtins_eval": (
            _call(4, _stack_global("builtins", "eval"), f"__import__('os').system('{touch}')"),
            "builtins.eval",
        ),
        "builtins_getattr": (_call(2, _global_line("builtins", "getattr"), "x", "y"), "getattr"),
        # A copyreg extension code registered (by some import) for os.system.
        "extension_code": (b"\x80\x02\x82\xf1" + _unicode(touch) + b"\x85R.", "extension code"),
        # BUILD on an allowed class itself: would set attributes of the class for the process.
        "build_on_class": (
            b"\x80\x04"
            + _stack_global("torch.distributed.checkpoint.metadata", "Metadata")
            + b"N}"
            + _unicode("__eq__")
            + b"N"
            + b"s\x86b.",
            "BUILD on torch.distributed.checkpoint.metadata.Metadata",
        ),
        # BUILD setting an undeclared field of an allowed instance.
        "build_undeclared": (
            b"\x80\x04"
            + _stack_global("torch.distributed.checkpoint.metadata", "Metadata")
            + b")\x81}"
            + _unicode("__reduce__")
            + b"Ns"
            + b"b.",
            "undeclared fields of Metadata",
        ),
        # Persistent ids, text and binary.
        "persid": (b"P" + touch.encode() + b"\n.", "persistent id"),
        "binpersid": (b"\x80\x02" + _unicode(touch) + b"Q.", "persistent id"),
        # Calling an allowed value that is not a class.
        "call_a_dtype": (_call(4, _stack_global("torch", "float32"), "x"), "calls torch.dtype"),
        # Protocol-0 instantiation.
        "inst": (b"(itorch\nSize\n.", "INST"),
        "plain_function": (_call(4, _stack_global("os", "system"), touch), "os.system"),
    }


def _commit_hostile(folder: Path, name: str, data: bytes) -> None:
    """Replace `name` in a committed checkpoint and rewrite its size and hash in the manifest."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def good_checkpoints(tmp_path_factory) -> Path:
    """Two committed checkpoints of run-a, steps 1 and 2."""
    root = tmp_path_factory.mktemp("good")
    ckpt = _checkpointer(root)
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    return root


@pytest.fixture
def extension_for_os_system():
    copyreg.add_extension("os", "system", 0xF1)
    yield
    copyreg.remove_extension("os", "system", 0xF1)


def test_every_allowed_global_is_a_class_or_cannot_be_called():
    for (module, name), value in ALLOWED.items():
        assert "." not in name, (module, name)
        assert isinstance(value, type) or not callable(value), (module, name)


@pytest.mark.usefixtures("extension_for_os_system")
def test_hostile_metadata_is_refused_no_code_runs_and_resume_falls_back(
    good_checkpoints, tmp_path, caplog
):
    marker = tmp_path / "MARKER"
    for name, (data, forbidden) in _hostile(marker, tmp_path / "out.pt").items():
        root = tmp_path / name
        shutil.copytree(good_checkpoints, root)
        folder = root / "step-00000002"
        _commit_hostile(folder, ".metadata", data)
        meta = folder / ".metadata"
        # Loading it directly: one line naming the file and the forbidden thing.
        with pytest.raises(CheckpointError) as refused:
            load(Storage(str(root)), str(folder), _state(0.0))
        message = str(refused.value)
        assert "\n" not in message and str(meta) in message, (name, message)
        assert forbidden in message, (name, message)
        # Resuming: the previous good checkpoint, with the reason in the log.
        caplog.clear()
        target = _state(0.0)
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            assert _checkpointer(root).restore_latest(target) == 1, name
        assert float(target["model"]["w"][0, 0]) == 1.0
        assert f"{folder} is damaged (checkpoint metadata {meta}: " in caplog.text, name
        assert forbidden in caplog.text, (name, caplog.text)
        assert not marker.exists(), f"{name} ran code"
    assert dcp_metadata.Metadata.__eq__ is not None  # build_on_class changed nothing


def test_metadata_pointing_outside_the_folder_is_refused(good_checkpoints, tmp_path, caplog):
    root = tmp_path / "ckpt"
    shutil.copytree(good_checkpoints, root)
    folder = root / "step-00000002"
    metadata = decode_metadata((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    _commit_hostile(folder, ".metadata", pickle.dumps(metadata))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _checkpointer(root).restore_latest(_state(0.0)) == 1
    assert "points at '../../../../etc/passwd', outside the checkpoint folder" in caplog.text


def test_metadata_larger_than_its_file_claims_is_refused(good_checkpoints, tmp_path, caplog):
    root = tmp_path / "ckpt"
    shutil.copytree(good_checkpoints, root)
    folder = root / "step-00000002"
    metadata = decode_metadata((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.length = 10**9
    _commit_hostile(folder, ".metadata", pickle.dumps(metadata))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _checkpointer(root).restore_latest(_state(0.0)) == 1
    assert "reads past the end of" in caplog.text


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"../../../../dev/zero": {"size": 0, "sha256": "0" * 64}}, "not a file in the checkpoint"),
        ({"/etc/passwd": {"size": 1, "sha256": "0" * 64}}, "not a file in the checkpoint"),
        ({"__0_0.distcp": {"size": "12"}}, "is malformed"),
        ({"__0_0.distcp": None}, "is malformed"),
        ({"__0_0.distcp": {"size": -1, "sha256": "0" * 64}}, "is malformed"),
    ],
    ids=["dev_zero", "absolute", "size_text", "null_entry", "negative"],
)
def test_hostile_manifest_entries_are_skipped_with_a_reason(
    good_checkpoints, tmp_path, caplog, entry, reason
):
    root = tmp_path / "ckpt"
    shutil.copytree(good_checkpoints, root)
    manifest_path = root / "step-00000002" / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].update(entry)
    manifest_path.write_text(json.dumps(manifest))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _checkpointer(root).restore_latest(_state(0.0)) == 1
    assert time.monotonic() - start < 30
    assert "step-00000002 is damaged" in caplog.text and reason in caplog.text


@pytest.mark.parametrize("body", ["[1, 2]", "null", '"text"', "{"], ids=str)
def test_a_manifest_that_is_not_an_object_is_skipped(good_checkpoints, tmp_path, caplog, body):
    root = tmp_path / "ckpt"
    shutil.copytree(good_checkpoints, root)
    (root / "step-00000002" / "MANIFEST.json").write_text(body)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _checkpointer(root).restore_latest(_state(0.0)) == 1
    assert "manifest unreadable" in caplog.text


# --- retention --------------------------------------------------------------------------------


def test_retention_never_deletes_the_only_good_checkpoint(tmp_path):
    """keep_temporary = 1 and a damaged newer step: resuming falls back to step 800, and the
    step 900 committed next must survive (the damaged 1000 does not count)."""
    first = _checkpointer(tmp_path, keep=1)
    first.save(800, _state(8.0), permanent=False)
    first.save(1000, _state(10.0), permanent=False)
    assert [e.step for e in committed(first.storage)] == [1000]  # 800 pruned, as configured
    shutil.copytree(tmp_path / "step-00001000", tmp_path / "step-00000800")
    manifest = json.loads((tmp_path / "step-00000800" / "MANIFEST.json").read_text())
    manifest["step"] = 800
    (tmp_path / "step-00000800" / "MANIFEST.json").write_text(json.dumps(manifest))
    shard = next((tmp_path / "step-00001000").glob("*.distcp"))
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])

    again = _checkpointer(tmp_path, keep=1)
    assert again.restore_latest(_state(0.0)) == 800
    again.save(900, _state(9.0), permanent=False)
    steps = [e.step for e in committed(again.storage)]
    assert 900 in steps, steps
    assert _checkpointer(tmp_path, keep=1).restore_latest(target := _state(0.0)) == 900
    assert float(target["model"]["w"][0, 0]) == 9.0


def test_retention_removes_the_manifest_first(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path, keep=1)
    ckpt.save(1, _state(1.0), permanent=False)
    removed: list[str] = []
    real_remove = Storage.remove

    def recording(self, path):
        removed.append(path)
        real_remove(self, path)

    monkeypatch.setattr(Storage, "remove", recording)
    ckpt.save(2, _state(2.0), permanent=False)
    gone = [p for p in removed if "step-00000001" in p]
    assert gone[0].endswith("step-00000001/MANIFEST.json"), removed


def test_keep_temporary_zero_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_temporary must be >= 1"):
        _checkpointer(tmp_path, keep=0)


# --- two runs, one checkpoint location ----------------------------------------------------------


def test_a_second_run_is_refused_and_never_touches_the_first_runs_checkpoints(tmp_path):
    first = _checkpointer(tmp_path, run_id="run-a")
    first.claim_location()
    first.save(4, _state(4.0), permanent=False)
    before = sorted(p.name for p in (tmp_path / "step-00000004").iterdir())

    second = _checkpointer(tmp_path, run_id="run-b")
    with pytest.raises(CheckpointError, match="belongs to another run") as refused:
        second.restore_latest(_state(0.0))
    assert "\n" not in str(refused.value) and "checkpoint.resume_from" in str(refused.value)
    with pytest.raises(CheckpointError, match="belongs to another run"):
        second.claim_location()
    second.save(4, _state(99.0), permanent=False)  # refused before it removes anything
    assert second.newest_committed is None
    assert sorted(p.name for p in (tmp_path / "step-00000004").iterdir()) == before
    target = _state(0.0)
    assert _checkpointer(tmp_path, run_id="run-a").restore_latest(target) == 4
    assert float(target["model"]["w"][0, 0]) == 4.0


def test_another_runs_checkpoint_is_not_resumed_unless_named(tmp_path, caplog):
    shared = tmp_path / "shared"
    _checkpointer(shared, run_id="run-a").save(3, _state(3.0), permanent=False)
    assert not (shared / manifest.OWNER).exists()  # as a location from before owners were
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _checkpointer(shared, run_id="run-b").restore_latest(_state(0.0)) is None
    assert "belongs to another run (run id run-a)" in caplog.text

    caplog.clear()
    mine = Checkpointer(
        Storage(str(tmp_path / "mine")),
        run_id="run-b",
        layout="test",
        async_mode="off",
        keep_temporary=1,
        logger=LOG,
        resume_from=str(shared / "step-00000003"),
    )
    target = _state(0.0)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert mine.restore_latest(target) == 3
    assert float(target["model"]["w"][0, 0]) == 3.0
    assert "of run run-a (checkpoint.resume_from), step 3" in caplog.text


# --- the same through training: two runs, one checkpoint.dir, different seeds --------------------

TINY = {
    "training__steps": 2,
    "training__global_batch_size": 4,
    "training__micro_batch_size": 4,
    "training__seq_len": 32,
    "data__max_bytes": 300_000,
    "checkpoint__interval_steps": 1,
    "checkpoint__at_end": False,
}


def test_two_runs_one_checkpoint_dir(tmp_path, capsys):
    shared = tmp_path / "shared"
    first = train_in_process(tmp_path / "a", **TINY, training__seed=1, checkpoint__dir=shared)
    before = {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    # distrain train refuses it before any worker starts (a local location's OWNER.json).
    cli = cli_in_process(
        capsys, "train", "--run.dir", str(tmp_path / "b"), "--checkpoint.dir", str(shared)
    )
    assert cli.returncode != 0 and not (tmp_path / "b").exists()
    errors = cli.stderr.strip().splitlines()
    assert len(errors) == 1 and f"checkpoint.dir {shared} belongs to another run" in errors[0]
    # The workers check it again (an object store's location is checked only there).
    with pytest.raises(CheckpointError) as refused:
        train_in_process(tmp_path / "b", **TINY, training__seed=2, checkpoint__dir=shared)
    assert "\n" not in str(refused.value)
    assert f"checkpoint.dir {shared} belongs to another run" in str(refused.value)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # refused before the first step
    assert {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()} == before

    # Named explicitly, another run's checkpoint is a starting point, said so in the log.
    rows = train_in_process(
        tmp_path / "c",
        **dict(TINY, training__steps=3),
        training__seed=2,
        checkpoint__resume_from=shared / "step-00000002",
    )
    assert [r["step"] for r in rows if "loss" in r] == [3]
    log = (tmp_path / "c" / "logs" / "rank0.log").read_text()
    assert f"starting from checkpoint {shared / 'step-00000002'} of run " in log
    manifest = tmp_path / "c" / "checkpoints" / "step-00000003" / "MANIFEST.json"
    own = json.loads(manifest.read_text())
    assert own["run_id"] == (tmp_path / "c" / "run_id").read_text().strip()
    assert own["run_id"] != (tmp_path / "a" / "run_id").read_text().strip()
    assert [r["step"] for r in first if "loss" in r] == [1, 2]


def test_generate_and_export_read_checkpoints_outside_the_run_folder_only_when_named(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    run = tmp_path / "run"
    train_in_process(run, **TINY, checkpoint__dir=elsewhere)
    for read in (
        lambda **kw: load_model(run, torch.device("cpu"), **kw),
        lambda **kw: load_run_model(run, **kw),
    ):
        with pytest.raises(ConfigError, match="outside the run folder; pass --checkpoint-dir"):
            read()
        _, step = read(checkpoint_dir=str(elsewhere))
        assert step == 2
