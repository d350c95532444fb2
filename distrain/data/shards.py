"""Sharded token datasets: a folder of shards and `index.json`, the one file that describes them.

A shard is a prepared token file (see tokfile.py): `shard-NNNNN.bin` with its document boundaries
`shard-NNNNN.bin.docs.npy`; each holds at most the dataset's `shard_tokens` tokens and ends at a
document boundary (only a document longer than a shard is cut). The index names every shard with
its token and document counts, its size in bytes and the SHA-256 of both files, the element type
and the tokenizer; it is written last and atomically, so a folder with an index is complete.

The index is data from storage, possibly hostile: it is parsed as JSON (never unpickled), its
size and every count are bounded, and a shard name is a plain file name, never a path, so a
reader only ever opens files inside the dataset folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import numpy as np

from distrain.data.corpus import DataError

FORMAT = "distrain-shards"
VERSION = 1
MAX_INDEX_BYTES = 64 << 20
MAX_SHARDS = 1_000_000
MAX_SHARD_TOKENS = 1 << 36
DTYPES = ("uint8", "uint16", "uint32", "int32")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Shard:
    name: str
    num_tokens: int
    num_documents: int
    sha256: str
    docs_sha256: str

    @property
    def docs_name(self) -> str:
        return f"{self.name}.docs.npy"


@dataclass(frozen=True)
class ShardIndex:
    tokenizer: str
    tokenizer_sha256: str
    vocab_size: int
    dtype: str
    eos_id: int | None
    shard_tokens: int
    shards: tuple[Shard, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def shard_bytes(self, shard: Shard) -> int:
        return shard.num_tokens * self.itemsize

    def to_json(self) -> str:
        fields = asdict(self)
        fields["shards"] = [asdict(s) for s in self.shards]
        return json.dumps({"format": FORMAT, "version": VERSION, **fields}, indent=1) + "\n"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


def parse_index(text: str | bytes, *, where: str) -> ShardIndex:
    """The index in `text` (read from `where`), checked field by field; a DataError naming
    `where` for anything that is not a well-formed index."""
    if len(text) > MAX_INDEX_BYTES:
        raise DataError(f"{where}: {len(text)} bytes is larger than any index ({MAX_INDEX_BYTES})")
    try:
        raw = json.loads(text)
        return _checked(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(
            f"{where} is not a {FORMAT} version {VERSION} index ({e}); prepare the data "
            "again with `distrain prepare --shard-tokens`"
        ) from None


def _int(raw: dict, key: str, low: int, high: int) -> int:
    value = raw[key]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{key} = {value!r} is not an integer in [{low}, {high}]")
    return value


def _str(raw: dict, key: str, pattern: re.Pattern | None = None) -> str:
    value = raw[key]
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"{key} is not a string")
    if pattern is not None and not pattern.fullmatch(value):
        raise ValueError(f"{key} {value[:80]!r} is not allowed here")
    return value


def _checked(raw: object) -> ShardIndex:
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
    dtype = _str(raw, "dtype")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shards_raw = raw["shards"]
    if not isinstance(shards_raw, list) or not 0 < len(shards_raw) <= MAX_SHARDS:
        raise ValueError(f"shards must be a list of 1 to {MAX_SHARDS} entries")
    shard_tokens = _int(raw, "shard_tokens", 1, MAX_SHARD_TOKENS)
    shards = []
    for entry in shards_raw:
        if not isinstance(entry, dict):
            raise ValueError("a shard entry is not an object")
        shards.append(
            Shard(
                name=_str(entry, "name", _NAME),
                num_tokens=_int(entry, "num_tokens", 0, shard_tokens),
                num_documents=_int(entry, "num_documents", 0, shard_tokens),
                sha256=_str(entry, "sha256", _SHA256),
                docs_sha256=_str(entry, "docs_sha256", _SHA256),
            )
        )
    if len({s.name for s in shards}) != len(shards):
        raise ValueError("two shards have the same name")
    eos_id = raw.get("eos_id")
    vocab_size = _int(raw, "vocab_size", 1, 1 << 32)
    if eos_id is not None:
        eos_id = _int(raw, "eos_id", 0, vocab_size - 1)
    return ShardIndex(
        tokenizer=_str(raw, "tokenizer"),
        tokenizer_sha256=_str(raw, "tokenizer_sha256"),
        vocab_size=vocab_size,
        dtype=dtype,
        eos_id=eos_id,
        shard_tokens=shard_tokens,
        shards=tuple(shards),
    )
