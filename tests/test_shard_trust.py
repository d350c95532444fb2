"""A sharded dataset's files are data that may have been planted or left behind: nothing on disk
is believed on its size alone.

- a file planted in the (predictable) cache folder with a shard's name and size is checked
  before it is read, and fetched again: the real shard is trained on;
- a dataset prepared again at the same URL (same-size shards, other text) is read anew, never
  from the old cache;
- a local folder's shard that is a symlink (to a file outside) is refused, as is one whose bytes
  differ from its index entry or that holds a token id beyond the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import fsspec
import numpy as np
import pytest
from s3 import s3  # noqa: F401

from distrain.data.corpus import DataError
from distrain.data.prepare import prepare
from distrain.data.shard_store import ShardStore

SHARD_TOKENS = 3000


def _dataset(root: Path, name: str, seed: int, *, upper: bool = False) -> Path:
    """A sharded dataset of seeded text; `upper`: the same text upper-cased (same-size shards,
    other tokens)."""
    rng = np.random.default_rng(seed)
    text = root / f"{name}-text"
    text.mkdir(parents=True)
    for i in range(10):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "shard"], 40 + 30 * i))
        (text / f"doc{i:02d}.txt").write_text((words.upper() if upper else words) + "\n")
    prepare([str(text)], out=str(root / name), tokenizer="bytes", shard_tokens=SHARD_TOKENS)
    return root / name


def _upload(folder: Path, url: str) -> None:
    fs, _ = fsspec.core.url_to_fs(url)
    fs.put(str(folder) + "/", url.removeprefix("s3://") + "/", recursive=True)


def test_a_planted_file_in_the_cache_is_not_trained_on(tmp_path, s3):  # noqa: F811
    real = _dataset(tmp_path, "real", 1)
    url = s3.url("trust", "planted")
    _upload(real, url)
    cache = tmp_path / "cache"
    name = "shard-00000.bin"
    first = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    folder = first.cache  # named after the URL and the index: predictable to a neighbour
    first.close()
    planted = bytes(255 - b for b in (real / name).read_bytes())  # same size, other tokens
    (folder / name).write_bytes(planted)
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    assert store.cache == folder
    path = store.local_path(store.by_name[name])
    assert path.read_bytes() == (real / name).read_bytes()
    store.close()


def test_a_dataset_prepared_again_at_the_same_url_is_read_anew(tmp_path, s3):  # noqa: F811
    old, new = _dataset(tmp_path, "old", 1), _dataset(tmp_path, "new", 1, upper=True)
    name = "shard-00000.bin"
    assert (old / name).stat().st_size == (new / name).stat().st_size
    assert (old / name).read_bytes() != (new / name).read_bytes()
    url = s3.url("trust", "again")
    cache = tmp_path / "cache"
    _upload(old, url)
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    assert store.local_path(store.by_name[name]).read_bytes() == (old / name).read_bytes()
    old_folder = store.cache
    store.close()
    _upload(new, url)
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    assert store.local_path(store.by_name[name]).read_bytes() == (new / name).read_bytes()
    assert store.cache != old_folder and not old_folder.exists()
    store.close()


def test_a_local_shard_linked_outside_the_folder_is_refused(tmp_path):
    folder = _dataset(tmp_path, "local", 1)
    name = "shard-00001.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes((folder / name).read_bytes())  # even the right bytes: not inside
    (folder / name).unlink()
    (folder / name).symlink_to(outside)
    with pytest.raises(DataError, match=f"{name} is a symlink or not a regular file") as info:
        ShardStore(str(folder))
    assert "\n" not in str(info.value)


def test_a_local_index_that_is_a_symlink_is_refused(tmp_path):
    folder = _dataset(tmp_path, "local", 1)
    other = tmp_path / "index-elsewhere.json"
    (folder / "index.json").rename(other)
    (folder / "index.json").symlink_to(other)
    with pytest.raises(DataError, match="index.json is a symlink"):
        ShardStore(str(folder))


def test_a_local_shard_whose_bytes_differ_from_its_index_is_refused_before_it_is_read(tmp_path):
    folder = _dataset(tmp_path, "local", 1)
    name = "shard-00001.bin"
    data = bytearray((folder / name).read_bytes())
    data[10] ^= 1  # same size
    (folder / name).write_bytes(bytes(data))
    store = ShardStore(str(folder))
    assert store.local_path(store.by_name["shard-00000.bin"]).is_file()
    with pytest.raises(DataError, match=f"{name} does not match its index entry"):
        store.local_path(store.by_name[name])
    store.close()


def test_token_ids_beyond_the_vocabulary_are_refused_in_one_line(tmp_path):
    """A folder whose index and shards were rewritten together (hashes matching) with a token id
    past the vocabulary: refused when the shard is first read, not as an IndexError in the
    embedding."""
    folder = _dataset(tmp_path, "local", 1)
    index = json.loads((folder / "index.json").read_text())
    entry = index["shards"][0]
    ids = np.fromfile(folder / entry["name"], dtype=index["dtype"])
    ids[5] = index["vocab_size"] + 44
    ids.tofile(folder / entry["name"])
    entry["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    (folder / "index.json").write_text(json.dumps(index))
    store = ShardStore(str(folder))
    with pytest.raises(DataError, match="holds token id 300, beyond the index's vocabulary of 256"):
        store.local_path(store.by_name["shard-00000.bin"])
    assert store.local_path(store.by_name["shard-00001.bin"]).is_file()
    store.close()
