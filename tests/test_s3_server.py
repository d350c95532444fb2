"""The loopback S3 server of tests/s3.py: plain fsspec URLs reach it from a subprocess, and
torch.distributed.checkpoint's fsspec writer/reader round-trip a state dict through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from s3 import S3Server, s3  # noqa: F401  (s3: the module-scoped fixture)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

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


def test_dcp_fsspec_round_trip(s3: S3Server) -> None:  # noqa: F811
    url = s3.url("ckpt")
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    dcp.save(state, storage_writer=FsspecWriter(url))

    fs, root = fsspec.url_to_fs(url)
    assert fs.exists(f"{root}/.metadata")

    loaded = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=FsspecReader(url))
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"].item() == 7
