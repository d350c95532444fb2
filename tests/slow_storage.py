"""Slow checkpoint storage for tests: `slowfile:///abs/path` is a local folder reached through
fsspec (so distrain takes its object-store code path) whose reads and writes are throttled to
`SlowFileSystem.bytes_per_s`, or stall forever on a shard (`stall`). The bytes still go to and
come from the disk: only their pace is a storage's that is slow or has stopped answering.

Run as a script, it trains one rank in a process of its own with the filesystem registered, so
that a hang watchdog ending that process (os._exit) ends only it:

    python tests/slow_storage.py RUN_DIR FIELDS_JSON --bytes-per-s N [--stall read|write]
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

PROTOCOL = "slowfile"
SHARD_SUFFIX = ".distcp"


def stall_forever() -> None:
    """A storage call that never returns (a dead NFS server, a hung object-store connection)."""
    threading.Event().wait()


class SlowFileSystem(AbstractFileSystem):
    """The local disk at `bytes_per_s` (class attributes: fsspec builds the instances)."""

    protocol = PROTOCOL
    root_marker = "/"
    bytes_per_s = float("inf")
    stall: str | None = None  # "read" or "write": of a shard file, forever

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.disk = LocalFileSystem()

    # Callers pass paths with or without the protocol (DCP passes URLs): the disk gets plain ones.
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return self.disk.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.disk.info(self._strip_protocol(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.disk.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.disk.mkdir(self._strip_protocol(path), create_parents=create_parents)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.disk.rm(self._strip_protocol(path), recursive=recursive, maxdepth=maxdepth)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.disk.mv(self._strip_protocol(path1), self._strip_protocol(path2))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> SlowFile:
        path = self._strip_protocol(path)
        return SlowFile(self.disk.open(path, mode), path, type(self))


class SlowFile(io.RawIOBase):
    """A local file whose every read and write first waits as long as the bytes would take."""

    def __init__(self, file: Any, path: str, fs: type[SlowFileSystem]):
        super().__init__()
        self.file, self.path, self.fs = file, path, fs

    def _pace(self, nbytes: int, kind: str) -> None:
        if self.fs.stall == kind and self.path.endswith(SHARD_SUFFIX):
            stall_forever()
        time.sleep(nbytes / self.fs.bytes_per_s)

    def readinto(self, buffer: Any) -> int:
        self._pace(memoryview(buffer).nbytes, "read")
        return self.file.readinto(buffer)

    def write(self, data: Any) -> int:
        self._pace(memoryview(data).nbytes, "write")
        return self.file.write(data)

    def readable(self) -> bool:
        return self.file.readable()

    def writable(self) -> bool:
        return self.file.writable()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.close()
        super().close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("fields", type=json.loads)
    parser.add_argument("--bytes-per-s", type=float, required=True)
    parser.add_argument("--stall", choices=("read", "write"))
    args = parser.parse_args()
    SlowFileSystem.bytes_per_s, SlowFileSystem.stall = args.bytes_per_s, args.stall
    fsspec.register_implementation(PROTOCOL, SlowFileSystem)

    from helpers import train_in_process

    train_in_process(args.run_dir, **args.fields)


if __name__ == "__main__":
    main()
