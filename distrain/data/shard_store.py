"""Where a sharded dataset's files come from: a local folder, read in place, or an fsspec URL
(`s3://bucket/prefix`) whose shards are downloaded into a bounded local cache.

Nothing on disk is believed on its size alone. Before a process first reads a shard, local or
cached, it checks it (`check_shard`): a regular file (not a symlink), of the index's size, whose
SHA-256 is the index's and whose token ids are in [0, the index's vocabulary). A local folder's
index must be a regular file too, and its shards are checked in the background as they are
wanted (`want`), or when first read. A shard that passed is not checked again in this process.

A remote shard is fetched by a background thread ahead of need (`want`), or when first read
(`local_path`). It is downloaded under a temporary name, checked, and only then renamed to its
own name: a partial or corrupt download is never read. The cache folder is named after the URL
and the index's own SHA-256, so a dataset prepared again at the same URL never reuses the
shards of the old one (whose folder is removed); it may not be a symlink, and a file already in
it is checked like a download before it is read, and fetched again when it fails. Above
`cache_bytes` the least recently used shards that are not wanted now are deleted (a reader that
has one open keeps reading it: the file goes when it is closed). The ranks of a node may share
the folder: each counts its own downloads against `cache_bytes`, a shard another evicted is
fetched again, and a download under way (a `.partial` file of a live process) is left alone.
Every storage call goes through `call(what, fn, *args)`, the caller's retry policy (training
passes the one checkpoints use, see checkpoint/storage.py).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import posixpath
import shutil
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from distrain.data.corpus import INDEX_NAME, DataError
from distrain.data.shards import MAX_INDEX_BYTES, Shard, ShardIndex, parse_index

Call = Callable[..., Any]
"""call(what, fn, *args) -> fn(*args), retried while its error may pass."""

FETCH_THREADS = 4
_CHUNK = 8 << 20
"""Bytes read at a time when checking a shard (a multiple of every token dtype's size)."""

log = logging.getLogger(__name__)


def check_shard(path: Path, shard: Shard, index: ShardIndex, *, where: str) -> None:
    """Raise DataError (one line) unless `path` is a regular file, not a symlink, holding exactly
    `shard` as the index describes it: its size, its SHA-256, token ids in [0, the index's
    vocabulary)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise DataError(f"{where}: {shard.name} is missing; prepare the dataset again") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(
            f"{where}: {shard.name} is a symlink or not a regular file; only the files inside "
            "a dataset folder are read: copy the shard in"
        )
    size = index.shard_bytes(shard)
    if info.st_size != size:
        raise DataError(
            f"{where}: {shard.name} holds {info.st_size} bytes, the index says {size}; the "
            "folder is incomplete or changed: prepare it again"
        )
    digest, low, high = hashlib.sha256(), 0, -1
    signed = np.dtype(index.dtype).kind == "i"
    with open(path, "rb", opener=_no_follow) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=index.dtype)
            if ids.size:
                high = max(high, int(ids.max()))
                if signed:
                    low = min(low, int(ids.min()))
    if digest.hexdigest() != shard.sha256:
        raise DataError(
            f"{where}: {shard.name} does not match its index entry (another SHA-256); the "
            "dataset was changed or damaged: prepare it again"
        )
    if low < 0 or high >= index.vocab_size:
        raise DataError(
            f"{where}: {shard.name} holds token id {low if low < 0 else high}, outside the "
            f"index's vocabulary [0, {index.vocab_size}); the dataset is damaged: prepare it again"
        )


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _read_regular(path: str, limit: int, *, where: str) -> bytes:
    """Up to `limit` bytes of the local file `path`, refused unless it is a regular file, not a
    symlink (checked on the open file: a link, a FIFO or a device is never read)."""
    refused = DataError(
        f"{where} is a symlink or not a regular file; only the files inside a dataset folder "
        "are read: copy it in"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise refused from None
        raise
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused
        return f.read(limit)


def _downloading(name: str) -> bool:
    """`name` is a download under way: a `.partial` file of a process still alive (the ranks of
    a node share a cache folder)."""
    parts = name.rsplit(".", 3)
    if len(parts) != 4 or parts[3] != "partial" or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _direct(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class ShardStore:
    """The index of the dataset at `url` and a local path for each of its shards."""

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str = "",
        cache_bytes: int = 0,
        call: Call = _direct,
        field: str = "data.path",
        min_cached_shards: int = 2,
    ) -> None:
        self.url, self.call, self.field = url.rstrip("/"), call, field
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)
        index_bytes = self._read_index()
        self.index = parse_index(index_bytes, where=f"{field} {self.url}/{INDEX_NAME}")
        self.by_name = {s.name: s for s in self.index.shards}
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cached: OrderedDict[str, int] = OrderedDict()
        self._wanted: set[str] = set()
        self._fetching: dict[str, Future[Path]] = {}
        self._verified: set[str] = set()
        """The shards this process has checked (check_shard)."""
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shard-fetch")
        if self.local:
            self.cache = Path(self.root)
            self._check_local_sizes()
            return
        if not cache_dir:
            raise DataError(f"{field} {url!r} is remote: set data.cache_dir to a local folder")
        largest = max(self.index.shard_bytes(s) for s in self.index.shards)
        need = min_cached_shards * largest
        if cache_bytes < need:
            raise DataError(
                f"data.cache_bytes = {cache_bytes} cannot hold the {min_cached_shards} shards of "
                f"{url!r} read now and next (the largest is {largest} bytes); set "
                f"data.cache_bytes >= {need} or a smaller data.shuffle_window_shards"
            )
        # The URL and the index's own hash: a dataset prepared again at the same URL (same-size
        # shards, other contents) gets a folder of its own; the old one's is removed.
        url_key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.cache = Path(cache_dir) / f"{url_key}-{hashlib.sha256(index_bytes).hexdigest()[:16]}"
        for old in Path(cache_dir).glob(f"{url_key}*") if Path(cache_dir).is_dir() else ():
            if old != self.cache:
                shutil.rmtree(old, ignore_errors=True)
        if self.cache.is_symlink():
            raise DataError(
                f"data.cache_dir: {self.cache} is a symlink; files are deleted and written in the "
                f"cache folder: remove the link (and check who can write to {cache_dir})"
            )
        self.cache.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.cache.iterdir():
            try:
                found.append((path.lstat(), path))
            except FileNotFoundError:
                pass  # evicted or renamed meanwhile by a rank sharing the folder
        for info, path in sorted(found, key=lambda f: f[0].st_mtime):
            shard = self.by_name.get(path.name)
            if shard is not None and info.st_size == self.index.shard_bytes(shard):
                # A candidate only: checked like a download before its first read here.
                self._cached[path.name] = info.st_size
            elif shard is not None or not _downloading(path.name):
                path.unlink(missing_ok=True)  # a cut-off download, a stale shard, anything else

    def _read_index(self) -> bytes:
        where = f"{self.field} {self.url}/{INDEX_NAME}"
        path = posixpath.join(self.root, INDEX_NAME)

        def read() -> bytes:
            with self.fs.open(path, "rb") as f:
                return f.read(MAX_INDEX_BYTES + 1)

        try:
            if self.local:
                return _read_regular(path, MAX_INDEX_BYTES + 1, where=where)
            return self.call(f"reading {where}", read)
        except FileNotFoundError:
            raise DataError(
                f"{where}: no such file; point {self.field} at a folder written by "
                "`distrain prepare --shard-tokens N`"
            ) from None

    def _check_local_sizes(self) -> None:
        """Every shard of a local folder is a regular file of its size (hashes are checked as the
        shards are first read: a large folder is not read through at every start)."""
        for shard in self.index.shards:
            path = Path(self.root) / shard.name
            info = path.lstat() if path.is_symlink() or path.exists() else None
            size = info.st_size if info is not None and stat.S_ISREG(info.st_mode) else -1
            if info is not None and not stat.S_ISREG(info.st_mode):
                raise DataError(
                    f"{self.field} {self.url!r}: {shard.name} is a symlink or not a regular "
                    "file; only the files inside a dataset folder are read: copy the shard in"
                )
            if size != self.index.shard_bytes(shard):
                raise DataError(
                    f"{self.field} {self.url!r}: {shard.name} holds {size} bytes, the index says "
                    f"{self.index.shard_bytes(shard)}; the folder is incomplete: prepare it again"
                )

    # --- the cache ---

    def want(self, names: Iterable[str]) -> None:
        """The shards read now or next: fetched (or, local, checked) in the background, never
        evicted while wanted."""
        names = list(names)
        with self._lock:
            self._wanted = set(names)
        for name in names:
            self._fetch(name)

    def local_path(self, shard: Shard) -> Path:
        """The shard's local file, checked; waits for its check or download when needed."""
        with self._lock:
            if shard.name in self._verified and (self.local or shard.name in self._cached):
                if not self.local:
                    self._cached.move_to_end(shard.name)
                return self.cache / shard.name
        return self._fetch(shard.name).result()

    def forget(self, shard: Shard) -> None:
        """The shard's file is gone (another process sharing the cache evicted it)."""
        with self._lock:
            self._cached.pop(shard.name, None)
            self._verified.discard(shard.name)

    def _fetch(self, name: str) -> Future[Path]:
        with self._lock:
            if name in self._verified and (self.local or name in self._cached):
                done: Future[Path] = Future()
                done.set_result(self.cache / name)
                return done
            future = self._fetching.get(name)
            if future is None:
                future = self._pool.submit(self._provide, self.by_name[name])
                self._fetching[name] = future
            return future

    def _provide(self, shard: Shard) -> Path:
        """The checked local file of `shard`: the local folder's, a cached one that passes the
        check, or a fresh download."""
        path = self.cache / shard.name
        try:
            if self.local or shard.name in self._cached:
                try:
                    check_shard(path, shard, self.index, where=f"{self.field} {self.url}")
                except DataError as error:
                    if self.local:
                        raise
                    log.warning("cached %s failed its check (%s): fetching it again", path, error)
                    with self._lock:
                        self._cached.pop(shard.name, None)
                    path.unlink(missing_ok=True)
                    path = self._download(shard)
            else:
                path = self._download(shard)
            with self._lock:
                self._verified.add(shard.name)
            return path
        finally:
            with self._lock:
                self._fetching.pop(shard.name, None)

    def _download(self, shard: Shard) -> Path:
        url = f"{self.url}/{shard.name}"
        size = self.index.shard_bytes(shard)
        final = self.cache / shard.name
        tmp = self.cache / f".{shard.name}.{os.getpid()}.{uuid.uuid4().hex}.partial"

        def get() -> None:
            with self.fs.open(posixpath.join(self.root, shard.name), "rb") as src:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with open(fd, "wb") as dst:
                    left = size + 1  # one byte more: a longer object fails the check
                    while left > 0 and (chunk := src.read(min(_CHUNK, left))):
                        dst.write(chunk)
                        left -= len(chunk)
            try:
                check_shard(tmp, shard, self.index, where=f"{self.field}: {url}")
            except DataError:
                tmp.unlink()
                raise

        try:
            self._make_room()
            self.call(f"downloading {url}", get)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._cached[shard.name] = size
        return final

    def _make_room(self) -> None:
        """Delete least recently used shards, not wanted now, until the ones cached and those
        being fetched fit in cache_bytes."""
        with self._lock:
            used = sum(self._cached.values()) + sum(
                self.index.shard_bytes(self.by_name[n]) for n in self._fetching
            )
            for name in list(self._cached):
                if used <= self.cache_bytes:
                    break
                if name in self._wanted:
                    continue
                used -= self._cached.pop(name)
                (self.cache / name).unlink(missing_ok=True)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._cached.values())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
