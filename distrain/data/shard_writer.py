"""`distrain prepare --shard-tokens N`: the parent's side that cuts the tokenized stream into the
shards of a dataset folder (see shards.py), writes them in background threads while workers go
on tokenizing, and resumes an interrupted prepare.

Shards are cut from the stream in unit order, so the folder does not depend on the number of
processes. Each finished shard gets a record `shard-NNNNN.bin.done.json` (its index entry, where
in the stream the next shard starts, and the identity of the job: inputs, tokenizer, options).
A rerun of the same job verifies the records' shards (regular files, not symlinks, of their
size and SHA-256), keeps the longest complete prefix, removes what follows it and tokenizes
again from the first unit that the next shard needs; `index.json` comes last, written aside
and renamed. Every file is written through a fresh temporary name (files.write_atomic), never
through a symlink planted in the folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import stat
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from distrain.data.corpus import INDEX_NAME
from distrain.data.shards import Shard, ShardIndex, shard_name
from distrain.errors import ConfigError
from distrain.files import write_atomic

WRITER_THREADS = 2
_HASH_CHUNK = 8 << 20


def _done_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.done.json"


def _regular_size(path: Path) -> int:
    """The size of `path`, -1 unless it is a regular file (a symlink is not kept: training
    refuses one)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return -1
    return info.st_size if stat.S_ISREG(info.st_mode) else -1


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> str:
    """Write aside, then rename: a file under its own name is whole; returns its SHA-256."""
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


class ShardWriter:
    """Takes each unit's (tokens, document lengths) in unit order, cuts shards of at most
    `shard_tokens` tokens at document boundaries and writes them; `finish` writes the index."""

    def __init__(self, folder: Path, *, shard_tokens: int, job: str, dtype: np.dtype) -> None:
        if shard_tokens < 1:
            raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
        self.folder, self.shard_tokens, self.job, self.dtype = folder, shard_tokens, job, dtype
        folder.mkdir(parents=True, exist_ok=True)
        self.shards: list[Shard] = self._kept_prefix()
        stop = self._stop_of_last()
        self.resume_unit, self.resume_offset = stop
        self._pending: list[Future[Shard]] = []
        self._pool = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="shard-writer")
        self._tokens: list[np.ndarray] = []
        self._lengths: list[int] = []
        self._count = 0
        self._units_seen = self.resume_unit

    # --- resuming ---

    def _record(self, name: str) -> dict | None:
        path = _done_path(self.folder, name)
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except ValueError:
            return None
        if record.get("job") != self.job:
            raise ConfigError(
                f"--out {str(self.folder)!r} holds shards of another prepare (other inputs, "
                "tokenizer or options); use an empty folder or the original command"
            )
        return record

    def _verified(self, record: dict) -> Shard | None:
        shard = Shard(**record["shard"])
        data = self.folder / shard.name
        docs = self.folder / shard.docs_name
        if _regular_size(data) != shard.num_tokens * self.dtype.itemsize:
            return None
        if _regular_size(docs) < 0 or _file_sha256(docs) != shard.docs_sha256:
            return None
        return shard if _file_sha256(data) == shard.sha256 else None

    def _kept_prefix(self) -> list[Shard]:
        """The verified shards 0..k-1 of an earlier run of this job; what follows is removed."""
        kept: list[Shard] = []
        self._stops: list[tuple[int, int]] = []
        while (record := self._record(shard_name(len(kept)))) is not None:
            shard = self._verified(record)
            if shard is None:
                break
            kept.append(shard)
            self._stops.append((int(record["stop"][0]), int(record["stop"][1])))
        for path in self.folder.glob("shard-*"):
            number = path.name.removeprefix("shard-").split(".", 1)[0]
            if not number.isdigit() or int(number) >= len(kept):
                path.unlink()
        (self.folder / INDEX_NAME).unlink(missing_ok=True)
        return kept

    def _stop_of_last(self) -> tuple[int, int]:
        return self._stops[-1] if self._stops else (0, 0)

    # --- writing ---

    def add(self, unit: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Unit `unit`'s tokens and document lengths (a resumed unit: from resume_offset)."""
        offset = self.resume_offset if unit == self.resume_unit else 0
        if offset:
            ends = np.cumsum(lengths)
            first = int(np.searchsorted(ends, offset, side="right"))
            lengths = lengths[first:].copy()
            if lengths.size:
                lengths[0] = ends[first] - offset
            tokens = tokens[offset:]
        start = 0
        for length in lengths.tolist():
            while length > 0:
                room = self.shard_tokens - self._count
                if length > room and self._count > 0:
                    self._close(unit, start + offset)
                    continue
                take = min(length, room)
                self._tokens.append(tokens[start : start + take])
                self._lengths.append(take)
                self._count += take
                start += take
                length -= take
                if self._count == self.shard_tokens:
                    self._close(unit, start + offset)
        self._units_seen = unit + 1

    def _close(self, unit: int, offset_in_unit: int) -> None:
        """Hand the current shard to a writer thread; the next starts at `offset_in_unit`."""
        if self._count == 0:
            return
        name = shard_name(len(self.shards) + len(self._pending))
        tokens = np.concatenate(self._tokens).astype(self.dtype, copy=False)
        lengths = np.asarray(self._lengths, dtype=np.int64)
        stop = (unit, offset_in_unit)
        self._pending.append(self._pool.submit(self._write, name, tokens, lengths, stop))
        self._tokens, self._lengths, self._count = [], [], 0
        # At most a few shards in memory: tokenizing waits for the writers, not the reverse.
        while sum(not f.done() for f in self._pending) > 2 * WRITER_THREADS:
            wait([f for f in self._pending if not f.done()], return_when="FIRST_COMPLETED")

    def _write(
        self, name: str, tokens: np.ndarray, lengths: np.ndarray, stop: tuple[int, int]
    ) -> Shard:
        boundaries = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        docs = io.BytesIO()
        np.save(docs, boundaries)
        docs_sha = _write_bytes(self.folder / f"{name}.docs.npy", docs.getvalue())
        sha = _write_bytes(self.folder / name, tokens.tobytes())
        shard = Shard(name, int(tokens.size), int(lengths.size), sha, docs_sha)
        record = {"job": self.job, "shard": asdict(shard), "stop": list(stop)}
        _write_bytes(_done_path(self.folder, name), json.dumps(record).encode())
        return shard

    def finish(self, index: ShardIndex) -> ShardIndex:
        """Close the last shard, wait for the writers and write the index (last, atomically)."""
        self._close(self._units_seen, 0)
        try:
            self.shards += [f.result() for f in self._pending]
        finally:
            self._pool.shutdown()
        if not self.shards:
            raise ConfigError("prepare: the inputs hold no tokens")
        full = replace(index, shard_tokens=self.shard_tokens, shards=tuple(self.shards))
        write_atomic(self.folder / INDEX_NAME, full.to_json())
        return full

    def abort(self) -> None:
        """Wait for the shards being written (their records make them count on a rerun)."""
        for future in self._pending:
            future.exception()
        self._pool.shutdown()
