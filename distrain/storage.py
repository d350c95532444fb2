"""Where checkpoints live: a local folder or an object-store URL (`s3://bucket/run`), via fsspec.

Credentials and endpoints come from the environment the way each fsspec backend reads them
(for s3fs: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...), so the same URL
works on a laptop and on a cluster without code-level options.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from distrain.torch_compat import FsspecReader, FsspecWriter


class Storage:
    """A root folder on some filesystem, with the few operations checkpoints need."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """A path of this storage as something a user can paste (a URL for object stores)."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def listdir(self, path: str | None = None) -> list[str]:
        """Names directly under `path` (the root by default); none when it does not exist."""
        path = path or self.root
        self.fs.invalidate_cache(path)  # other ranks and processes write here too
        if not self.fs.exists(path):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_text(self, path: str) -> str:
        with self.fs.open(path, "r") as f:
            return f.read()

    def write_text_atomic(self, path: str, text: str) -> None:
        """Readers see the old state or the whole new file, never a part of it. Object stores
        publish an object whole on PUT; a local file is written aside, synced, then renamed."""
        if not self.local:
            self.fs.pipe_file(path, text.encode())
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def sha256(self, path: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        return digest.hexdigest()

    def dcp_writer(self, path: str) -> FileSystemWriter:
        return FileSystemWriter(path) if self.local else FsspecWriter(self.url_of(path))

    def dcp_reader_class(self) -> type[FileSystemReader]:
        return FileSystemReader if self.local else FsspecReader

    def reader_path(self, path: str) -> str:
        return path if self.local else self.url_of(path)
