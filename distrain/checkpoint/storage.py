"""Where checkpoints live: a local folder or an object-store URL (`s3://bucket/run`), via fsspec.

Credentials and endpoints come from the environment the way each fsspec backend reads them
(for s3fs: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...), so the same URL
works on a laptop and on a cluster without code-level options.

Every storage call goes through one retry policy: an error that may pass (a refused connection,
a timeout, a 5xx) is retried with exponential backoff until `retry_s` seconds have gone by, then
raised as a one-line StorageError naming the URL and the cause. Errors that cannot pass by
waiting (a missing file, no permission, a full disk) are raised at once, unchanged. An outage
ridden out is still logged (the `distrain` logger, so the rank's log): one warning at an
operation's first retry and one when it succeeds after retries, saying for how long the storage
was unreachable (`distrain diagnose` reports these).

DCP writes through `HashingWriter`s: each file's size and SHA-256 are computed from the bytes as
they go out, so no rank reads back what it wrote to describe it in the manifest. On an object
store each of DCP's storage phases (creating the folder, writing this rank's files, writing the
metadata) goes through the same retry policy as a whole: a phase that failed on an error that may
pass is done again, rewriting the same names (an object is replaced whole by its PUT).

Durability: a local file is fsynced before it counts as written, and a rename is made durable by
fsyncing its folder. An object is durable once its PUT (or multipart upload) completes, so
object-store writes are never synced: DCP would fall back to a node-wide os.sync() per file.
`remove` on S3 also aborts the multipart uploads still open under the path, which a save killed
mid-upload leaves behind, unlisted and billed.

Every byte a checkpoint reads or writes (DCP's shards both ways, checksum verification, small
files) is reported to the storage's `on_progress`, at least every `CHUNK_BYTES`: the hang
watchdog counts it as progress, so a save or resume slower than its timeout is not a hang, while
a storage that stops moving bytes still is.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import posixpath
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from distrain.errors import CheckpointError
from distrain.observe.logs import LOGGER_NAME
from distrain.torch_compat import FsspecReader, FsspecWriter

T = TypeVar("T")
Progress = Callable[[int], None]
"""Told the number of bytes each time some were read or written."""
Retrying = Callable[..., Any]
"""`Storage.retrying`: (what, fn[, retryable]) -> fn() under the storage's retry policy."""

CHUNK_BYTES = 1 << 20
"""The most bytes one read or write passes on at a time, so that progress is reported while a
single large tensor or shard moves (at 10 MB/s, every 0.1 s)."""

# Errors no amount of waiting fixes: retrying them only delays the report.
_PERMANENT_TYPES = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    ValueError,
    TypeError,
    KeyError,
)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
_FIRST_DELAY_S = 0.1
_MAX_DELAY_S = 5.0
_log = logging.getLogger(LOGGER_NAME)


class StorageError(CheckpointError):
    """Storage that could not be reached within checkpoint.storage_retry_s."""


def _missing_credentials(error: BaseException) -> bool:
    """botocore's "no credentials" errors (s3fs raises them as they are): waiting never supplies
    credentials. Checked only where botocore is loaded, i.e. where an S3 store is in use."""
    exceptions = sys.modules.get("botocore.exceptions")
    return exceptions is not None and isinstance(
        error, exceptions.NoCredentialsError | exceptions.PartialCredentialsError
    )


def transient(error: BaseException) -> bool:
    """Whether `error` may pass by waiting (connection, timeout, server errors)."""
    if isinstance(error, _PERMANENT_TYPES) or _missing_credentials(error):
        return False
    if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS:
        return False
    return isinstance(error, Exception)


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, short enough for a log line."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


def _unwatched(nbytes: int) -> None:
    """The progress report of a storage no one watches."""


class Storage:
    """A root folder on some filesystem, with the few operations checkpoints need, each retried
    for up to `retry_s` seconds while its error may pass; `on_progress` hears of the bytes they
    move."""

    def __init__(self, url: str, *, retry_s: float = 0.0, on_progress: Progress = _unwatched):
        self.url, self.retry_s, self.on_progress = url, retry_s, on_progress
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` under the retry policy; `what` names the operation in errors."""
        return self.retrying(what, lambda: fn(*args, **kwargs))

    def retrying(
        self,
        what: str,
        fn: Callable[[], T],
        retryable: Callable[[BaseException], bool] = transient,
    ) -> T:
        """`fn()` under the retry policy, retried while `retryable` says its error may pass."""
        start = time.monotonic()
        delay, attempts = _FIRST_DELAY_S, 1
        while True:
            try:
                result = fn()
            except Exception as e:
                waited = time.monotonic() - start
                if not retryable(e):
                    raise
                if waited + delay > self.retry_s:
                    raise StorageError(
                        f"storage {self.url} unreachable: {what} failed ({one_line(e)}) after "
                        f"{attempts} attempt(s) in {waited:.1f} s (checkpoint.storage_retry_s = "
                        f"{self.retry_s:g})"
                    ) from e
                if attempts == 1:
                    _log.warning(
                        "storage %s unreachable: %s failed (%s); retrying for up to %g s "
                        "(checkpoint.storage_retry_s)",
                        self.url,
                        what,
                        one_line(e),
                        self.retry_s,
                    )
                time.sleep(delay)
                delay, attempts = min(2 * delay, _MAX_DELAY_S), attempts + 1
                continue
            if attempts > 1:
                _log.warning(
                    "storage %s reachable again: %s succeeded after %d attempts; unreachable "
                    "for %.1f s",
                    self.url,
                    what,
                    attempts,
                    time.monotonic() - start,
                )
            return result

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """A path of this storage as something a user can paste (a URL for object stores)."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def listdir(self, path: str | None = None) -> list[str]:
        """Names directly under `path` (the root by default); none when it does not exist."""
        path = path or self.root

        def names() -> list[str]:
            self.fs.invalidate_cache(path)  # other ranks and processes write here too
            if not self.fs.exists(path):
                return []
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))

        return self.call(f"listing {self.url_of(path)}", names)

    def exists(self, path: str) -> bool:
        return self.call(f"checking {self.url_of(path)}", self.fs.exists, path)

    def read_text(self, path: str) -> str:
        def read() -> str:
            with self.fs.open(path, "r") as f:
                return f.read()

        text = self.call(f"reading {self.url_of(path)}", read)
        self.on_progress(len(text))
        return text

    def write_text_atomic(self, path: str, text: str) -> None:
        """Readers see the old state or the whole new file, never a part of it. Object stores
        publish an object whole on PUT; a local file is written aside, synced, then renamed."""
        if self.local:
            self._write_local_atomic(path, text)
        else:
            self.call(f"writing {self.url_of(path)}", self.fs.pipe_file, path, text.encode())
        self.on_progress(len(text))

    @staticmethod
    def _write_local_atomic(path: str, text: str) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path) or ".")
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def remove(self, path: str) -> None:
        """`path` and everything under it, and on S3 the multipart uploads open under it."""

        def rm() -> None:
            if _is_s3(self.fs):
                # Before the existence check: a save killed before any object completed leaves
                # only open uploads, and they make nothing exist.
                _abort_uploads(self.fs, path)
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

        self.call(f"removing {self.url_of(path)}", rm)

    def check_writable(self) -> None:
        """Write and delete a small file at the root, so that a location no save can reach (no
        credentials, read-only, a file in the way) is reported before the first step rather
        than at the first save, hundreds of steps in."""
        probe = self.path(f".distrain-probe-{uuid.uuid4().hex}")
        try:
            self.makedirs(self.root)
            self.write_text_atomic(probe, "probe")
            self.remove(probe)
        except StorageError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"checkpoint location {self.url} is not writable ({one_line(e)}); fix "
                "checkpoint.dir or its credentials and permissions"
            ) from e

    def makedirs(self, path: str) -> None:
        self.call(f"creating {self.url_of(path)}", self.fs.makedirs, path, exist_ok=True)

    def size(self, path: str) -> int:
        return int(self.call(f"sizing {self.url_of(path)}", self.fs.size, path))

    def sha256(self, path: str, *, max_bytes: int) -> str:
        """The SHA-256 of the file's first `max_bytes` + 1 bytes: a file that is longer than
        expected (or never ends, like a device) fails its checksum instead of being read on."""

        def digest() -> str:
            h = hashlib.sha256()
            left = max_bytes + 1
            with self.fs.open(path, "rb") as f:
                while left > 0 and (chunk := f.read(min(CHUNK_BYTES, left))):
                    h.update(chunk)
                    left -= len(chunk)
                    self.on_progress(len(chunk))
            return h.hexdigest()

        return self.call(f"reading {self.url_of(path)}", digest)

    def free_bytes(self) -> int | None:
        """Free space where the checkpoints go (local folders only; None for object stores)."""
        if not self.local:
            return None
        probe = self.root
        while not os.path.exists(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)
        return shutil.disk_usage(probe).free

    def dcp_writer(self, path: str) -> HashingWriter:
        if self.local:
            return HashingFileSystemWriter(path, self.on_progress)
        return HashingFsspecWriter(self.url_of(path), self.on_progress, self.retrying)

    def dcp_reader_class(self) -> type[FileSystemReader]:
        """DCP's reader for this storage, telling `on_progress` of the bytes it reads."""
        return _progress_reader(FileSystemReader if self.local else FsspecReader, self.on_progress)

    def reader_path(self, path: str) -> str:
        return path if self.local else self.url_of(path)


def _fsync_dir(path: str) -> None:
    """Make the entries of folder `path` durable: a crash may undo a rename until then."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_s3(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "s3" in protocols


def _abort_uploads(fs: Any, path: str) -> None:
    """Abort every multipart upload open at `path` or under it (s3fs's own helper lists the whole
    bucket, unpaginated)."""
    bucket, key, _ = fs.split_path(path)
    under = f"{key.rstrip('/')}/" if key else ""
    markers: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key, **markers)
        for upload in page.get("Uploads", []):
            if upload["Key"] == key or upload["Key"].startswith(under):
                fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])
        if not page.get("IsTruncated"):
            return
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def _progress_reader(base: type[FileSystemReader], on_progress: Progress) -> type[FileSystemReader]:
    """`base` (a DCP reader class) reading through a filesystem that reports progress."""

    class ProgressReader(base):  # type: ignore[valid-type,misc]
        def __init__(self, path: str, *args: Any, **kwargs: Any):
            super().__init__(path, *args, **kwargs)
            self.fs = _ProgressFileSystem(self.fs, on_progress)

    return ProgressReader


class _ProgressFileSystem:
    """DCP's filesystem object with `create_stream` reporting the bytes read from it."""

    def __init__(self, inner: Any, on_progress: Progress):
        self.inner, self.on_progress = inner, on_progress

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self.inner.create_stream(path, mode) as stream:
            yield _ProgressReadStream(stream, self.on_progress)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _ProgressReadStream:
    """A read stream that reports what it reads, at most `CHUNK_BYTES` at a time: torch.load
    reads a tensor with one `readinto`, which on slow storage may take longer than the hang
    timeout for a single large tensor."""

    def __init__(self, raw: Any, on_progress: Progress):
        self.raw, self.on_progress = raw, on_progress

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and (got := self.raw.readinto(view[done : done + CHUNK_BYTES])):
            self.on_progress(got)
            done += got
        return done

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:  # to the end: only DCP's metadata, a small file
            data = self.raw.read()
            self.on_progress(len(data))
            return data
        parts = []
        while size > 0 and (part := self.raw.read(min(size, CHUNK_BYTES))):
            self.on_progress(len(part))
            parts.append(part)
            size -= len(part)
        return b"".join(parts)

    def __getattr__(self, name: str) -> Any:  # seek, tell, seekable, close, ...
        return getattr(self.raw, name)


class _HashingStream:
    """A write stream that feeds every byte it passes on to a SHA-256, a byte count and
    `on_progress` (at most `CHUNK_BYTES` at a time), and notes the first OSError of a write
    (torch.save turns it into a vaguer error)."""

    def __init__(self, raw: Any, on_error: Callable[[OSError], None], on_progress: Progress):
        self.raw, self.on_error, self.on_progress = raw, on_error, on_progress
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        # torch.save writes a tensor's storage in one call: passed on whole, a multi-GB tensor
        # on slow storage would report no progress until it is all written.
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view):
            chunk = view[taken : taken + CHUNK_BYTES]
            wrote = self._write_chunk(chunk)
            taken += wrote
            if wrote < len(chunk):
                break  # the raw stream took part of it: the caller writes the rest
        return taken

    def _write_chunk(self, chunk: memoryview) -> int:
        try:
            written = self.raw.write(chunk)
        except OSError as e:
            self.on_error(e)
            raise
        # A raw stream may take part of the buffer; hash exactly what it took.
        taken = len(chunk) if written is None else written
        self.digest.update(chunk[:taken])
        self.size += taken
        self.on_progress(taken)
        return taken

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class _HashingFileSystem:
    """DCP's filesystem object with `create_stream` hashing what it writes; renames carry the
    record along (DCP writes `.metadata` under a temporary name, then renames it)."""

    def __init__(self, inner: Any, writer: HashingWriter):
        self.inner, self.writer = inner, writer

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" in mode and "+" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self.inner.create_stream(path, mode) as raw:
                stream = _HashingStream(raw, self.writer.note_error, self.writer.on_progress)
                yield stream
        except OSError as e:  # also from the final flush when the file closes
            self.writer.note_error(e)
            raise
        self.writer.record(path, stream.size, stream.digest.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:
        self.inner.rename(path, new_path)
        self.writer.renamed(path, new_path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class HashingWriter:
    """Mixin for DCP's file writers: `written` maps each file this rank wrote (by name) to its
    size and SHA-256, computed while writing; `planned_bytes` is what this rank set out to write;
    `write_error` is the first OSError a write raised (torch.save may re-raise it as something
    less telling, such as "unexpected pos"); `on_progress` hears of every byte written."""

    fs: Any

    def _start_hashing(self, on_progress: Progress) -> None:
        self.on_progress = on_progress
        self._lock = threading.Lock()
        self.written: dict[str, dict[str, Any]] = {}
        self.planned_bytes = 0
        self.write_error: OSError | None = None
        self.fs = _HashingFileSystem(self.fs, self)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self.planned_bytes = sum(
            _item_bytes(item) for item in plan.items if item.type != WriteItemType.BYTE_IO
        )
        return super().write_data(plan, planner)  # type: ignore[misc]

    def record(self, path: Any, size: int, sha256: str) -> None:
        with self._lock:
            self.written[posixpath.basename(os.fspath(path))] = {"size": size, "sha256": sha256}

    def renamed(self, path: Any, new_path: Any) -> None:
        old, new = (posixpath.basename(os.fspath(p)) for p in (path, new_path))
        with self._lock:
            if old in self.written:
                self.written[new] = self.written.pop(old)

    def note_error(self, error: OSError) -> None:
        with self._lock:
            self.write_error = self.write_error or error


def _item_bytes(item: Any) -> int:
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * item.tensor_data.properties.dtype.itemsize


class HashingFileSystemWriter(HashingWriter, FileSystemWriter):
    def __init__(self, path: str, on_progress: Progress):
        super().__init__(path)
        self._start_hashing(on_progress)


class HashingFsspecWriter(HashingWriter, FsspecWriter):
    """DCP's fsspec writer, hashing, with each storage phase retried as a whole by `retrying`
    (the storage's policy). A failed write is retried only while both the error DCP raised and
    the first error a write hit may pass: torch.save reports a full store as "unexpected pos"."""

    def __init__(self, path: str, on_progress: Progress, retrying: Retrying):
        # No sync_files: object-store streams have no fileno, so DCP would os.sync() the whole
        # node per file, for objects that are durable once their upload completes.
        super().__init__(path, sync_files=False)
        self._start_hashing(on_progress)
        self._retrying = retrying

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        prepare = super().prepare_local_plan
        return self._retrying("creating the checkpoint folder", lambda: prepare(plan))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        write = super().write_data

        def attempt() -> Any:
            self.write_error = None
            return write(plan, planner)

        def retryable(error: BaseException) -> bool:
            return transient(error) and (self.write_error is None or transient(self.write_error))

        return self._retrying("writing this rank's checkpoint files", attempt, retryable)

    def finish(self, metadata: Any, results: Any) -> None:
        finish = super().finish
        self._retrying("writing the checkpoint's metadata", lambda: finish(metadata, results))
