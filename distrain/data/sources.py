"""The run's training data as a mixture of sources, and its validation set, from `[data]`.

`data.path` alone is one source: a text corpus or token file (dataset.py), or a sharded dataset
folder or URL (sharded.py). `[[data.sources]]` lists several, each a token file or a sharded
dataset made with data.tokenizer, with a weight. The validation set is the first source's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from distrain.config.schema import DataConfig, SourceConfig, source_names
from distrain.data.corpus import DataError, check_token_ids, is_sharded, read_token_file
from distrain.data.dataset import TokenDataset, build_datasets, loss_mask_of, split_tokens
from distrain.data.documents import DocumentIndex, document_index
from distrain.data.mixture import Mixture, Source, salt
from distrain.data.order import Permutation, ShardWindows
from distrain.data.shard_store import Call, ShardStore
from distrain.data.sharded import ShardedTokens, shard_samples, sharded_datasets
from distrain.data.tokenizer import load_tokenizer
from distrain.errors import ConfigError

CallFor = Callable[[str], Call]
"""The retry policy for the storage at a URL (see shard_store.Call)."""


def _direct_for(url: str) -> Call:
    return lambda what, fn, *args: fn(*args)


def build_mixture(
    cfg: DataConfig,
    seq_len: int,
    *,
    seed: int,
    vocab_size: int | None = None,
    call_for: CallFor = _direct_for,
) -> tuple[Mixture, TokenDataset]:
    """(the training mixture, the validation set)."""
    if not cfg.sources:
        one = SourceConfig(path=cfg.path, weight=1.0, name="train")
        if not is_sharded(cfg.path):
            train, val = build_datasets(cfg, seq_len, vocab_size=vocab_size)
            return Mixture.single(train, seed=seed), val
        source, val = _source(cfg, one, "data.path", seq_len, seed, None, vocab_size, call_for)
        return Mixture([source], seed=seed), val
    names = source_names(cfg)
    sources, vals = [], []
    for i, (spec, name) in enumerate(zip(cfg.sources, names, strict=True)):
        named = SourceConfig(path=spec.path, weight=spec.weight, name=name)
        field = f"data.sources[{i}] ({name!r})"
        key = salt(name) if len(cfg.sources) > 1 else None
        source, val = _source(cfg, named, field, seq_len, seed, key, vocab_size, call_for)
        sources.append(source)
        vals.append(val)
    return Mixture(sources, seed=seed), vals[0]


def _source(
    cfg: DataConfig,
    spec: SourceConfig,
    field: str,
    seq_len: int,
    seed: int,
    key: int | None,
    vocab_size: int | None,
    call_for: CallFor,
) -> tuple[Source, TokenDataset]:
    tokenizer = load_tokenizer(cfg.tokenizer)
    if is_sharded(spec.path):
        store = ShardStore(
            spec.path,
            cache_dir=cfg.cache_dir,
            cache_bytes=cfg.cache_bytes,
            call=call_for(spec.path),
            field=field,
            min_cached_shards=2 * cfg.shuffle_window_shards,
        )
        index = store.index
        if index.tokenizer_sha256 != tokenizer.fingerprint:
            raise ConfigError(
                f"{field} {spec.path!r} was prepared with tokenizer {index.tokenizer!r} (vocab "
                f"{index.vocab_size}) but data.tokenizer is {cfg.tokenizer!r} (vocab "
                f"{tokenizer.vocab_size}); prepare it with --tokenizer {cfg.tokenizer}"
            )
        if vocab_size is not None and index.vocab_size > vocab_size:
            raise DataError(
                f"{field} {spec.path!r} holds ids of a {index.vocab_size}-token vocabulary, "
                f"beyond model.vocab_size {vocab_size}; set model.vocab_size >= "
                f"{index.vocab_size}"
            )
        tokens = ShardedTokens(store)
        documents = _documents(cfg, spec.path, None, field)
        train, val = sharded_datasets(
            tokens, seq_len, cfg.val_fraction, where=field, documents=documents
        )
        order = ShardWindows(
            shard_samples(train, tokens), seed=seed, window=cfg.shuffle_window_shards, salt=key
        )
        return Source(spec.name, spec.weight, train, order, store), val
    path = Path(spec.path)
    if not path.is_file():
        raise DataError(
            f"{field}: no such token file or sharded dataset {spec.path!r} (a mixture reads "
            "token files and folders from `distrain prepare`)"
        )
    array = read_token_file(path, cfg.token_dtype, cfg.tokenizer)
    if vocab_size is not None:
        check_token_ids(array, vocab_size, field)
    train_ranges, val_ranges = split_tokens(array, cfg.val_fraction)
    documents = _documents(cfg, spec.path, array.size, field)
    mask = loss_mask_of(cfg, spec.path, field)
    train = TokenDataset(array, train_ranges, seq_len, documents=documents, loss_mask=mask)
    val = TokenDataset(array, val_ranges, seq_len, documents=documents, loss_mask=mask)
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"{field}: {array.size} tokens give {len(train)} train and {len(val)} validation "
            f"samples of {seq_len + 1} tokens; use more data or a smaller training.seq_len"
        )
    order = Permutation(len(train), seed=seed, salt=key)
    return Source(spec.name, spec.weight, train, order), val


def _documents(
    cfg: DataConfig, path: str, num_tokens: int | None, field: str
) -> DocumentIndex | None:
    """A source's document boundaries for data.document_masking: a token file's own
    (num_tokens given) or data.eos_id; a sharded dataset's by data.eos_id."""
    if not cfg.document_masking:
        return None
    if num_tokens is not None:
        one = dataclasses.replace(cfg, path=path, sources=(), format="tokens")
        try:
            return document_index(one, num_tokens)
        except DataError as e:
            raise DataError(f"{field}: {e}") from None
    if cfg.eos_id is None:
        raise DataError(
            f"{field}: data.document_masking on a sharded dataset takes its documents from "
            "data.eos_id (the token that ends each document); set it"
        )
    return DocumentIndex(eos_id=cfg.eos_id)
