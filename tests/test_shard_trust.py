"""A sharded dataset's files are data that may have been planted or left behind: nothing on disk
is believed on its size alone.

- a file planted in the (predictable) cache folder with a shard's name and size (valid token
  ids, other text) is checked before it is read, and fetched again: the real shard is trained
  on; a symlink planted there (to the right bytes, or dangling) is replaced by a download, and
  a cache folder that is a symlink is refused before anything in it is deleted;
- a dataset prepared again at the same URL (same-size shards, other text) is read anew, never
  from the old cache;
- a local folder's shard or index that is a symlink (to a file outside) is refused, the index
  before it is read, as is a shard whose bytes differ from its index entry or that holds a
  token id outside the vocabulary (above it, or negative in a signed type);
- a prepare run again over a folder whose shard was replaced by a symlink writes the shard
  anew instead of keeping the link (the file outside is untouched).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
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


def _cache_folder(url: str, cache: Path) -> Path:
    """The cache folder of the dataset at `url`: named after the URL and the index, so
    predictable to a neighbour."""
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    store.close()
    return store.cache


def test_a_planted_file_in_the_cache_is_not_trained_on(tmp_path, s3):  # noqa: F811
    real = _dataset(tmp_path, "real", 1)
    url = s3.url("trust", "planted")
    _upload(real, url)
    cache = tmp_path / "cache"
    name = "shard-00000.bin"
    folder = _cache_folder(url, cache)
    # The real tokens backwards: same size, every id in the vocabulary, other text.
    planted = np.fromfile(real / name, dtype=np.uint16)[::-1]
    assert planted.tobytes() != (real / name).read_bytes()
    planted.tofile(folder / name)
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    assert store.cache == folder
    path = store.local_path(store.by_name[name])
    assert path.read_bytes() == (real / name).read_bytes()
    store.close()


def test_planted_links_in_the_cache_are_replaced_not_followed(tmp_path, s3):  # noqa: F811
    real = _dataset(tmp_path, "real", 1)
    url = s3.url("trust", "links")
    _upload(real, url)
    cache = tmp_path / "cache"
    folder = _cache_folder(url, cache)
    outside = tmp_path / "outside.bin"
    outside.write_bytes((real / "shard-00000.bin").read_bytes())  # the right bytes, elsewhere
    (folder / "shard-00000.bin").symlink_to(outside)
    (folder / "shard-00001.bin").symlink_to(tmp_path / "nowhere")
    store = ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    for name in ("shard-00000.bin", "shard-00001.bin"):
        path = store.local_path(store.by_name[name])
        assert not path.is_symlink() and path.read_bytes() == (real / name).read_bytes()
    assert outside.read_bytes() == (real / "shard-00000.bin").read_bytes()
    store.close()


def test_a_cache_folder_that_is_a_symlink_is_refused(tmp_path, s3):  # noqa: F811
    real = _dataset(tmp_path, "real", 1)
    url = s3.url("trust", "linked-cache")
    _upload(real, url)
    cache = tmp_path / "cache"
    folder = _cache_folder(url, cache)
    shutil.rmtree(folder)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious\n")
    folder.symlink_to(victim, target_is_directory=True)
    with pytest.raises(DataError, match=f"data.cache_dir: {folder} is a symlink") as info:
        ShardStore(url, cache_dir=str(cache), cache_bytes=1 << 30)
    assert "\n" not in str(info.value)
    assert (victim / "precious.txt").read_text() == "precious\n"


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
    # Linked after the run opened the folder: refused when first read.
    (folder / name).unlink()
    (folder / name).write_bytes(outside.read_bytes())
    store = ShardStore(str(folder))
    (folder / name).unlink()
    (folder / name).symlink_to(outside)
    with pytest.raises(DataError, match=f"{name} is a symlink or not a regular file"):
        store.local_path(store.by_name[name])
    store.close()


def test_a_local_index_that_is_a_symlink_is_refused_before_it_is_read(tmp_path):
    folder = _dataset(tmp_path, "local", 1)
    other = tmp_path / "elsewhere.txt"
    other.write_text("not an index\n")  # read, it would fail as a malformed index instead
    (folder / "index.json").unlink()
    (folder / "index.json").symlink_to(other)
    with pytest.raises(DataError, match="index.json is a symlink or not a regular file") as info:
        ShardStore(str(folder))
    assert "\n" not in str(info.value)


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


@pytest.mark.parametrize(("dtype", "bad"), [("uint16", 300), ("int32", -3)])
def test_token_ids_outside_the_vocabulary_are_refused_in_one_line(tmp_path, dtype, bad):
    """A folder whose index and shards were rewritten together (hashes matching) with a token id
    outside the vocabulary: refused when the shard is first read, not as an IndexError in the
    embedding."""
    folder = _dataset(tmp_path, "local", 1)
    index = json.loads((folder / "index.json").read_text())
    for i, entry in enumerate(index["shards"]):
        ids = np.fromfile(folder / entry["name"], dtype=index["dtype"]).astype(dtype)
        if i == 0:
            ids[5] = bad
        ids.tofile(folder / entry["name"])
        entry["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    index["dtype"] = dtype
    (folder / "index.json").write_text(json.dumps(index))
    store = ShardStore(str(folder))
    message = f"shard-00000.bin holds token id {bad}, outside the index's vocabulary [0, 256)"
    with pytest.raises(DataError, match=re.escape(message)) as info:
        store.local_path(store.by_name["shard-00000.bin"])
    assert "\n" not in str(info.value)
    assert store.local_path(store.by_name["shard-00001.bin"]).is_file()
    store.close()


def test_a_prepare_run_again_writes_a_linked_shard_anew(tmp_path):
    folder = _dataset(tmp_path, "local", 1)
    name = "shard-00000.bin"
    real = (folder / name).read_bytes()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(real)  # the right bytes: only the link is wrong
    (folder / name).unlink()
    (folder / name).symlink_to(outside)
    prepare(
        [str(tmp_path / "local-text")], out=str(folder), tokenizer="bytes",
        shard_tokens=SHARD_TOKENS,
    )  # fmt: skip
    assert not (folder / name).is_symlink() and (folder / name).read_bytes() == real
    assert outside.read_bytes() == real
    store = ShardStore(str(folder))
    assert store.local_path(store.by_name[name]).read_bytes() == real
    store.close()
