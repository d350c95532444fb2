"""Sharded datasets, mixtures and the exact resume on any world size, in this process:

- `distrain prepare --shard-tokens` writes the same tokens as the single-file prepare, in shards
  of at most N tokens cut at document boundaries, with each shard's boundaries beside it; an
  interrupted prepare keeps its verified shards and rewrites only the rest (to identical bytes,
  with another number of workers).
- the index is data: names that would leave the folder, absurd counts, other types and
  non-JSON are refused in one line.
- the global stream of a three-source mixture (two sharded datasets, one token file), read on 4
  ranks, resumed on 2, then on 3 (the positions from a checkpoint-like state dict, some ranks
  with the background thread), concatenates to the 1-rank stream bit for bit; the resumed
  loader reads only the samples of its own batches (O(1) resume). A state without the sources'
  positions, the broken variant, does not reproduce it.
- new weights after a resume: every source continues from its own position, and one log line
  says so; the mixture's shares follow the weights.
- a source prepared with another tokenizer, or with a vocabulary larger than model.vocab_size,
  is refused in one line.
- an S3 dataset (SeaweedFS) read through a cache smaller than the dataset gives the local
  folder's batches bit for bit, never holds more than data.cache_bytes, drops a partial
  download left in the cache, and refuses a shard whose bytes differ from its index entry.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from s3 import s3  # noqa: F401

from distrain.config.schema import DataConfig, SourceConfig
from distrain.data.corpus import DataError
from distrain.data.loader import DistributedBatchLoader
from distrain.data.prepare import prepare
from distrain.data.shard_store import ShardStore
from distrain.data.shards import parse_index
from distrain.data.sources import build_mixture

SHARD_TOKENS = 3000
SEQ = 16
G = 12


def _texts(folder: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "shard", "token"], 20 + 25 * i)
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words) + f" {i}\n")
    return folder


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    out = {}
    for name, n, seed in (("web", 16, 1), ("code", 12, 2)):
        inputs = _texts(root / f"{name}-text", n, seed)
        prepare([str(inputs)], out=str(root / name), tokenizer="bytes", shard_tokens=SHARD_TOKENS)
        out[name] = root / name
    inputs = _texts(root / "math-text", 8, 3)
    prepare([str(inputs)], out=str(root / "math.bin"), tokenizer="bytes")
    out["math"] = root / "math.bin"
    return out


def test_shards_hold_the_single_file_tokens_bounded_at_document_boundaries(tmp_path, datasets):
    inputs = next(p for p in datasets["web"].parent.iterdir() if p.name == "web-text")
    prepare([str(inputs)], out=str(tmp_path / "one.bin"), tokenizer="bytes")
    whole = np.fromfile(tmp_path / "one.bin", dtype=np.uint16)
    whole_docs = np.load(tmp_path / "one.bin.docs.npy")
    index = parse_index((datasets["web"] / "index.json").read_text(), where="test")
    assert len(index.shards) > 3
    parts, starts = [], [0]
    for shard in index.shards:
        tokens = np.fromfile(datasets["web"] / shard.name, dtype=np.uint16)
        docs = np.load(datasets["web"] / shard.docs_name)
        assert 0 < tokens.size <= SHARD_TOKENS and tokens.size == shard.num_tokens
        assert docs[0] == 0 and docs[-1] == tokens.size and docs.size == shard.num_documents + 1
        parts.append(tokens)
        starts.append(starts[-1] + tokens.size)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    # Every shard edge is a document boundary of the single file (no document here is longer
    # than a shard, so none is cut).
    assert set(starts) <= set(whole_docs.tolist())


def test_an_interrupted_prepare_keeps_its_verified_shards(tmp_path, datasets):
    inputs = next(p for p in datasets["code"].parent.iterdir() if p.name == "code-text")
    out = tmp_path / "ds"
    prepare([str(inputs)], out=str(out), tokenizer="bytes", shard_tokens=SHARD_TOKENS)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    names = sorted(p.name for p in out.glob("shard-*.bin"))
    assert len(names) >= 4
    # What a prepare killed mid-way leaves: no index, a shard half-written under its temporary
    # name, the last shards missing, and one kept shard damaged since.
    (out / "index.json").unlink()
    for name in names[-2:]:
        for p in out.glob(f"{name}*"):
            p.unlink()
    (out / f"{names[-2]}.tmp").write_bytes(b"partial")
    damaged = out / names[1]
    damaged.write_bytes(b"\0\0" + damaged.read_bytes()[2:])
    kept_inode = os.stat(out / names[0]).st_ino
    prepare([str(inputs)], out=str(out), tokenizer="bytes", shard_tokens=SHARD_TOKENS, workers=2)
    assert os.stat(out / names[0]).st_ino == kept_inode  # verified and kept, not rewritten
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ix: ix["shards"][0].update(name="../../etc/passwd"), "is not allowed here"),
        (lambda ix: ix["shards"][0].update(name="/abs/shard.bin"), "is not allowed here"),
        (lambda ix: ix["shards"][0].update(num_tokens=1 << 50), "is not an integer in"),
        (lambda ix: ix.update(dtype="object"), "dtype 'object'"),
        (lambda ix: ix["shards"].append(dict(ix["shards"][0])), "the same name"),
        (lambda ix: ix.update(format="pickle"), "format 'pickle'"),
    ],
)
def test_a_hostile_index_is_refused_in_one_line(datasets, change, message):
    raw = json.loads((datasets["web"] / "index.json").read_text())
    change(raw)
    with pytest.raises(DataError, match=message) as info:
        parse_index(json.dumps(raw), where="data.path x/index.json")
    assert "\n" not in str(info.value) and "data.path x/index.json" in str(info.value)
    with pytest.raises(DataError, match="is not a distrain-shards"):
        parse_index(b"\x80\x04\x95 pickle bytes", where="x")


def _mixture(datasets, weights=(0.5, 0.3, 0.2), **data):
    cfg = DataConfig(
        sources=tuple(
            SourceConfig(path=str(datasets[n]), weight=w, name=n)
            for n, w in zip(("web", "code", "math"), weights, strict=True)
        ),
        shuffle_window_shards=2,
        **data,
    )
    mixture, _ = build_mixture(cfg, SEQ, seed=7, vocab_size=256)
    return mixture


def _loader(mixture, rank: int, size: int, prefetch: int = 0) -> DistributedBatchLoader:
    return DistributedBatchLoader(
        mixture,
        global_batch_size=G,
        micro_batch_size=G // size // 2 if size < 4 else 1,
        dp_rank=rank,
        dp_size=size,
        seed=7,
        prefetch_batches=prefetch,
    )


def _steps(loaders: list[DistributedBatchLoader], n: int) -> list[torch.Tensor]:
    """n global batches: every rank's micro-batches' inputs, concatenated in rank order."""
    out = []
    for _ in range(n):
        out.append(torch.cat([x for loader in loaders for x, _ in loader.next_batch()]))
    return out


def test_the_stream_resumes_bit_for_bit_on_any_world_size(datasets):
    reference = _steps([_loader(_mixture(datasets), 0, 1)], 30)

    four = [_loader(_mixture(datasets), r, 4, prefetch=2 * (r % 2)) for r in range(4)]
    got = _steps(four, 7)
    states = [loader.state_dict() for loader in four]
    assert all(
        torch.equal(s["sources"]["code"]["position"], states[0]["sources"]["code"]["position"])
        for s in states
    )
    for loader in four:
        loader.close()

    two = [_loader(_mixture(datasets), r, 2, prefetch=2) for r in range(2)]
    reads: list[int] = []
    for loader in two:
        loader.load_state_dict(states[0])
        for source in loader.mixture.sources:
            read = source.dataset.get_batch
            source.dataset.get_batch = lambda idx, read=read: reads.append(len(idx)) or read(idx)
    got += _steps(two, 11)
    # O(1): nothing was replayed; the resumed ranks read the samples of their batches only.
    assert sum(reads) <= 11 * G + len(two) * 2 * G  # plus what the threads prepared ahead
    state = two[0].state_dict()
    for loader in two:
        loader.close()

    three = [_loader(_mixture(datasets), r, 3) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    got += _steps(three, 12)
    assert len(got) == len(reference)
    for step, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert torch.equal(a, b), f"global batch {step} differs"

    # The broken variant: the global position alone, each source restarted from a guess.
    broken = {"samples_consumed": state["samples_consumed"], "sources": {
        name: {"position": torch.tensor(int(state["samples_consumed"]) // 3), "weight": w["weight"]}
        for name, w in state["sources"].items()
    }}  # fmt: skip
    wrong = _loader(_mixture(datasets), 0, 1)
    wrong.load_state_dict(broken)
    assert not all(
        torch.equal(a, b) for a, b in zip(_steps([wrong], 12), reference[18:], strict=True)
    )


def test_new_weights_continue_every_source_where_it_stopped(datasets, caplog):
    before = _loader(_mixture(datasets), 0, 1)
    _steps([before], 5)
    state = before.state_dict()
    after = _loader(_mixture(datasets, weights=(0.1, 0.1, 0.8)), 0, 1)
    with caplog.at_level(logging.INFO, logger="distrain"):
        after.load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if "weights changed" in r.getMessage()]
    assert len(lines) == 1 and "math 0.2 -> 0.8" in lines[0], lines
    positions = after.positions.copy()
    np.testing.assert_array_equal(positions, before.positions)
    choice = after.mixture.choose(5 * G, 6 * G)
    batch = torch.cat([x for x, _ in after.next_batch()])
    for s, source in enumerate(after.mixture.sources):
        rows = np.flatnonzero(choice == s)
        expect = source.order.samples(positions[s] + np.arange(rows.size))
        x, _ = source.dataset.get_batch(expect)
        assert torch.equal(batch[rows], x), source.name


def test_the_mixture_follows_its_weights_and_seed(datasets):
    mixture = _mixture(datasets)
    choice = mixture.choose(0, 20_000)
    shares = np.bincount(choice, minlength=3) / choice.size
    sigma = np.sqrt(mixture.weights * (1 - mixture.weights) / choice.size)
    assert np.all(np.abs(shares - mixture.weights) < 4 * sigma), shares
    np.testing.assert_array_equal(choice[100:200], mixture.choose(100, 200))
    mixture.seed = 8
    assert not np.array_equal(choice[:200], mixture.choose(0, 200))


def test_a_source_of_another_tokenizer_is_refused(datasets):
    cfg = DataConfig(
        sources=(SourceConfig(path=str(datasets["web"]), weight=1.0, name="web"),),
        tokenizer=f"hf:{Path(__file__).parent / 'data' / 'bpe-300.json'}",
    )
    with pytest.raises(
        Exception, match=r"data.sources\[0\] \('web'\) .* was prepared with tokenizer 'bytes'"
    ):
        build_mixture(cfg, SEQ, seed=7)


def test_a_source_beyond_the_model_vocabulary_is_refused(datasets):
    cfg = DataConfig(sources=(SourceConfig(path=str(datasets["web"]), weight=1.0, name="web"),))
    message = r"\('web'\) .* holds ids of a 256-token vocabulary, beyond model.vocab_size 128"
    with pytest.raises(DataError, match=message) as info:
        build_mixture(cfg, SEQ, seed=7, vocab_size=128)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def remote(s3, datasets):  # noqa: F811
    import fsspec

    fs, _ = fsspec.core.url_to_fs(s3.url())
    url = s3.url("datasets", "web")
    fs.put(str(datasets["web"]) + "/", url.removeprefix("s3://") + "/", recursive=True)
    return url


def test_an_s3_dataset_streams_through_a_bounded_cache(tmp_path, datasets, remote):
    index = parse_index((datasets["web"] / "index.json").read_text(), where="x")
    shard_bytes = max(index.shard_bytes(s) for s in index.shards)
    cache_bytes = 4 * shard_bytes  # two windows of 2 shards, less than the dataset
    assert cache_bytes < sum(index.shard_bytes(s) for s in index.shards)
    stale = tmp_path / "cache"
    local = DataConfig(path=str(datasets["web"]), shuffle_window_shards=2)
    far = DataConfig(
        path=remote, cache_dir=str(stale), cache_bytes=cache_bytes, shuffle_window_shards=2
    )
    near, _ = build_mixture(local, SEQ, seed=3)
    ref = _loader(near, 0, 1)
    mixture, _ = build_mixture(far, SEQ, seed=3)
    store = mixture.sources[0].store
    assert store is not None and not store.local
    # A download cut off in an earlier run (its process is gone), under its temporary name:
    # removed, never read.
    (store.cache / ".shard-00000.bin.99999999.0a1b.partial").write_bytes(b"x" * 10)
    mixture, _ = build_mixture(far, SEQ, seed=3)
    store = mixture.sources[0].store
    assert not list(store.cache.glob("*.partial"))
    loader = _loader(mixture, 0, 1, prefetch=2)
    epoch_steps = 2 * len(near) // G  # two epochs: every shard evicted and fetched again
    for _ in range(epoch_steps):
        a = torch.cat([x for x, _ in loader.next_batch()])
        b = torch.cat([x for x, _ in ref.next_batch()])
        assert torch.equal(a, b)
        assert _bytes_in(store.cache) <= cache_bytes and store.cached_bytes <= cache_bytes
    loader.close()
    store.close()
    assert _bytes_in(store.cache) <= cache_bytes


def _bytes_in(folder: Path) -> int:
    """Bytes of the files in `folder`, downloads under way included (one renamed or deleted
    while counting is skipped)."""
    total = 0
    for path in folder.iterdir():
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_a_shard_that_differs_from_its_index_is_refused(tmp_path, s3, datasets):  # noqa: F811
    import fsspec

    fs, _ = fsspec.core.url_to_fs(s3.url())
    url = s3.url("datasets", "damaged")
    fs.put(str(datasets["code"]) + "/", url.removeprefix("s3://") + "/", recursive=True)
    name = "shard-00001.bin"
    data = bytearray(fs.cat_file(f"{url}/{name}"))
    data[10] ^= 1
    fs.pipe_file(f"{url}/{name}", bytes(data))
    store = ShardStore(url, cache_dir=str(tmp_path), cache_bytes=1 << 30)
    with pytest.raises(DataError, match=f"{name} does not match its index entry") as info:
        store.local_path(store.by_name[name])
    assert "\n" not in str(info.value)
    assert not (store.cache / name).exists() and not list(store.cache.glob("*.partial"))
    assert store.local_path(store.by_name["shard-00000.bin"]).is_file()
    store.close()


def test_a_download_rides_out_an_outage_under_the_storage_retry_rules(tmp_path, s3, remote):  # noqa: F811
    import threading

    from s3 import _clear_s3fs_cache, through_gateway

    from distrain.checkpoint.storage import Storage

    with through_gateway(s3) as (relayed, gateway):
        saved = dict(os.environ)
        os.environ.update(relayed.env)
        _clear_s3fs_cache()
        try:
            patient = ShardStore(
                remote, cache_dir=str(tmp_path / "a"), cache_bytes=1 << 30,
                call=Storage(remote, retry_s=30).call,
            )  # fmt: skip
            gateway.cut()
            threading.Timer(0.5, gateway.restore).start()
            path = patient.local_path(patient.by_name["shard-00000.bin"])
            assert gateway.refused > 0
            index = patient.index
            assert path.stat().st_size == index.shard_bytes(index.shards[0])
            patient.close()
        finally:
            os.environ.clear()
            os.environ.update(saved)
            _clear_s3fs_cache()


def test_sources_are_tables_in_the_config_file(tmp_path, datasets):
    from distrain.config.io import load_config
    from distrain.errors import ConfigError

    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[[data.sources]]\npath = "{datasets["web"]}"\nweight = 2\n'
        f'[[data.sources]]\npath = "{datasets["math"]}"\nname = "m"\n'
    )
    cfg = load_config(toml)
    assert [(s.path, s.weight, s.name) for s in cfg.data.sources] == [
        (str(datasets["web"]), 2.0, ""),
        (str(datasets["math"]), 1.0, "m"),
    ]
    for overrides, message in [
        ([("data.path", "x.bin")], "data.path .* and data.sources are both set"),
        ([("data.sources", "a")], r"write it as \[\[data.sources\]\] tables"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(toml, overrides)
    toml.write_text('[[data.sources]]\npath = "a"\nwieght = 2\n')
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: unknown key 'wieght'"):
        load_config(toml)
    toml.write_text('[[data.sources]]\npath = "a"\nweight = 0\n')
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight = 0.0 must be > 0"):
        load_config(toml)
    with pytest.raises(ConfigError, match="'s3://b/web' is remote: set data.cache_dir"):
        load_config(None, [("data.path", "s3://b/web")])
