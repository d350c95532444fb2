"""Where a sharded dataset's files come from: a local folder, read in place, or an fsspec URL
(`s3://bucket/prefix`) whose shards are downloaded into a bounded local cache.

A remote shard is fetched by a background thread ahead of need (`prefetch`), or when first read
(`local_path`). It is downloaded under a temporary name, its size and SHA-256 are checked against
the index, and only then renamed to its own name: a partial or corrupt download is never read.
Above `cache_bytes` the least recently used shards that are not wanted now are deleted (a reader
that has one open keeps reading it: the file goes when it is closed). The ranks of a node may
share the folder: each counts its own downloads against `cache_bytes`, a shard another evicted is
fetched again, and a download under way (a `.partial` file of a live process) is left alone.
Every storage call goes through `call(what, fn, *args)`, the caller's retry policy (training
passes the one checkpoints use, see checkpoint/storage.py).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from distrain.data.corpus import INDEX_NAME, DataError
from distrain.data.shards import MAX_INDEX_BYTES, Shard, ShardIndex, parse_index

Call = Callable[..., Any]
"""call(what, fn, *args) -> fn(*args), retried while its error may pass."""

FETCH_THREADS = 4
_CHUNK = 8 << 20


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
        self.index = self._read_index()
        self.by_name = {s.name: s for s in self.index.shards}
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cached: OrderedDict[str, int] = OrderedDict()
        self._wanted: set[str] = set()
        self._fetching: dict[str, Future[Path]] = {}
        self._pool: ThreadPoolExecutor | None = None
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
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.cache = Path(cache_dir) / digest
        self.cache.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.cache.iterdir(), key=lambda p: p.stat().st_mtime):
            shard = self.by_name.get(path.name)
            if shard is not None and path.stat().st_size == self.index.shard_bytes(shard):
                self._cached[path.name] = path.stat().st_size
            elif shard is not None or not _downloading(path.name):
                path.unlink(missing_ok=True)  # a cut-off download, a stale shard, anything else
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shard-fetch")

    def _read_index(self) -> ShardIndex:
        where = f"{self.field} {self.url}/{INDEX_NAME}"
        path = posixpath.join(self.root, INDEX_NAME)

        def read() -> bytes:
            with self.fs.open(path, "rb") as f:
                return f.read(MAX_INDEX_BYTES + 1)

        try:
            text = self.call(f"reading {where}", read)
        except FileNotFoundError:
            raise DataError(
                f"{where}: no such file; point {self.field} at a folder written by "
                "`distrain prepare --shard-tokens N`"
            ) from None
        return parse_index(text, where=where)

    def _check_local_sizes(self) -> None:
        for shard in self.index.shards:
            path = Path(self.root) / shard.name
            size = path.stat().st_size if path.is_file() else -1
            if size != self.index.shard_bytes(shard):
                raise DataError(
                    f"{self.field} {self.url!r}: {shard.name} holds {size} bytes, the index says "
                    f"{self.index.shard_bytes(shard)}; the folder is incomplete: prepare it again"
                )

    # --- the cache ---

    def want(self, names: Iterable[str]) -> None:
        """The shards read now or next: fetched in the background, never evicted while wanted."""
        names = list(names)
        with self._lock:
            self._wanted = set(names)
        if not self.local:
            for name in names:
                self._fetch(name)

    def local_path(self, shard: Shard) -> Path:
        """The shard's local file; waits for its download when it is not cached yet."""
        if self.local:
            return self.cache / shard.name
        with self._lock:
            if shard.name in self._cached:
                self._cached.move_to_end(shard.name)
                return self.cache / shard.name
        return self._fetch(shard.name).result()

    def forget(self, shard: Shard) -> None:
        """The shard's file is gone (another process sharing the cache evicted it)."""
        with self._lock:
            self._cached.pop(shard.name, None)

    def _fetch(self, name: str) -> Future[Path]:
        with self._lock:
            if name in self._cached:
                done: Future[Path] = Future()
                done.set_result(self.cache / name)
                return done
            future = self._fetching.get(name)
            if future is None:
                assert self._pool is not None
                future = self._pool.submit(self._download, self.by_name[name])
                self._fetching[name] = future
            return future

    def _download(self, shard: Shard) -> Path:
        url = f"{self.url}/{shard.name}"
        size = self.index.shard_bytes(shard)
        final = self.cache / shard.name
        tmp = self.cache / f".{shard.name}.{os.getpid()}.{uuid.uuid4().hex}.partial"

        def get() -> None:
            h = hashlib.sha256()
            with self.fs.open(posixpath.join(self.root, shard.name), "rb") as src:
                with open(tmp, "wb") as dst:
                    left = size + 1  # one byte more: a longer object fails the check
                    while left > 0 and (chunk := src.read(min(_CHUNK, left))):
                        dst.write(chunk)
                        h.update(chunk)
                        left -= len(chunk)
            got = tmp.stat().st_size
            if got != size or h.hexdigest() != shard.sha256:
                tmp.unlink()
                raise DataError(
                    f"{self.field}: {url} does not match its index entry ({got} bytes, "
                    f"{size} expected, or another SHA-256); the dataset was changed or "
                    "damaged: prepare and upload it again"
                )

        try:
            self._make_room()
            self.call(f"downloading {url}", get)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._fetching.pop(shard.name, None)
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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
