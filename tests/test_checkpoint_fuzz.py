"""Seeded mutations of a real checkpoint, each resumed: every outcome must be the previous good
checkpoint with a one-line reason, the intact newest one bit for bit, or a clean one-line
CheckpointError; never another exception, never a hang past a bound, never a wrong state.
Mutations that also rewrite the manifest's hash (an attacker's) may load what they wrote."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError

LOG = logging.getLogger("distrain_test.checkpoint_fuzz")
MUTATIONS = 300
RESTORE_BOUND_S = 30.0


def _state(value: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((16, 8), value), "b": torch.arange(5.0) * value},
        "trainer": {"step": torch.tensor(int(value)), "name": f"run-{value}", "seen": [1, 2, 3]},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(16, 8), "b": torch.zeros(5)},
        "trainer": {"step": torch.tensor(0), "name": "", "seen": []},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _checkpointer(root: Path) -> Checkpointer:
    return Checkpointer(
        Storage(str(root)),
        run_id="fuzz",
        layout="test",
        async_mode="off",
        keep_temporary=2,
        logger=LOG,
    )


def _rewrite_hash(folder: Path, name: str) -> None:
    manifest_path = folder / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def _mutate(folder: Path, rng: random.Random) -> str:
    """One seeded mutation of the checkpoint in `folder`; returns its description."""
    files = sorted(p.name for p in folder.iterdir())
    kind = rng.choice(
        ["flip", "truncate", "delete", "extra_file", "manifest_drop", "manifest_add", "attacker"]
    )
    name = rng.choice(files)
    path = folder / name
    data = bytearray(path.read_bytes())
    if kind in ("flip", "attacker"):
        if kind == "attacker":  # rewrites the hash too, as whoever can write the folder would
            name = rng.choice([".metadata", *[f for f in files if f.endswith(".distcp")]])
            path = folder / name
            data = bytearray(path.read_bytes())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        if kind == "attacker":
            _rewrite_hash(folder, name)
    elif kind == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif kind == "delete":
        path.unlink()
    elif kind == "extra_file":
        (folder / f"extra{rng.randrange(100)}.distcp").write_bytes(rng.randbytes(64))
    else:
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        listed = sorted(manifest["files"])
        if kind == "manifest_drop":
            del manifest["files"][rng.choice(listed)]
        else:
            extra = rng.choice(["../escape", "x.distcp", "/abs", "..", "a/b", "ok.bin"])
            manifest["files"][extra] = rng.choice(
                [{"size": 3, "sha256": "0" * 64}, {"size": "3"}, [], {"sha256": 5}]
            )
        (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    return f"{kind} {name}"


def _restore(root: Path) -> tuple[Any, dict[str, Any]]:
    """restore_latest in a thread; (its step, or the exception it raised), and the state."""
    target = _blank()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(_checkpointer(root).restore_latest(target))
        except BaseException as e:  # the test judges which ones are acceptable
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(RESTORE_BOUND_S)
    assert not thread.is_alive(), f"restore still running after {RESTORE_BOUND_S} s"
    return outcome[0], target


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mutated_checkpoints_resume_the_previous_one_or_fail_cleanly(tmp_path, caplog):
    good = tmp_path / "good"
    ckpt = _checkpointer(good)
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    rng = random.Random(20261201)
    outcomes: dict[str, int] = {}
    for i in range(MUTATIONS):
        root = tmp_path / f"m{i}"
        shutil.copytree(good, root)
        what = _mutate(root / "step-00000002", rng)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            result, state = _restore(root)
        if isinstance(result, CheckpointError):
            assert "\n" not in str(result), (what, str(result))
            outcomes["clean error"] = outcomes.get("clean error", 0) + 1
        elif result == 1:
            assert _same(state, _state(1.0)), what
            reasons = [r.getMessage() for r in caplog.records if "step-00000002" in r.getMessage()]
            assert len(reasons) == 1 and "\n" not in reasons[0], (what, reasons)
            outcomes["previous"] = outcomes.get("previous", 0) + 1
        elif what.startswith("attacker"):
            # Whoever may rewrite a file and its hash may also write other weights: what they
            # cannot do is run code, read outside the folder, hang or crash the resume.
            assert result == 2, (what, repr(result))
            outcomes["attacker's bytes loaded"] = outcomes.get("attacker's bytes loaded", 0) + 1
        else:
            assert result == 2, (what, repr(result))
            assert _same(state, _state(2.0)), f"{what}: step 2 resumed with other values"
            outcomes["newest intact"] = outcomes.get("newest intact", 0) + 1
        shutil.rmtree(root)
    # Most mutations must be caught by verification: the fallback is the common outcome.
    assert outcomes.get("previous", 0) > MUTATIONS // 2, outcomes
    print(f"{MUTATIONS} mutations: {outcomes}")
