"""Corpus readers: turn `data.path` into one flat array of tokens (bytes of text, or a token file).

Text is read as raw bytes (the byte tokenizer's tokens) and concatenated in sorted path order, so
the same files give the same stream on every machine. Token files are memory-mapped, not copied.
Opening the data also checks what only its contents can tell: token ids the model has no
embedding for (refused), and "text" that is mostly not text, such as an executable (a warning).
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import numpy as np

from distrain.config.schema import DataConfig
from distrain.data.tokenizer import load_tokenizer
from distrain.data.tokfile import check_tokenizer, read_sidecar
from distrain.errors import DistrainError
from distrain.observe.logs import LOGGER_NAME

INDEX_NAME = "index.json"
"""The file that makes a folder a sharded dataset (shards.py)."""
_SKIPPED_DIRS = ("site-packages", "dist-packages")
_TOKEN_SUFFIXES = (".bin", ".npy")
# Bytes that are no part of text: C0 controls other than tab, newlines, form feed; and DEL.
_CONTROL_BYTES = np.array([b for b in range(32) if b not in b"\t\n\v\f\r"] + [127], np.uint8)
# Above this share of invalid UTF-8 and control bytes, a text corpus is probably binary (an ELF
# executable has ~65%, source code and prose ~0%).
MAX_NON_TEXT_FRACTION = 0.3
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16
_CHUNK_TOKENS = 1 << 24


class DataError(DistrainError, ValueError):
    """Data that cannot be used for training; the message names the config field to change."""


def read_corpus(cfg: DataConfig, *, vocab_size: int | None = None) -> np.ndarray:
    """The whole corpus as a 1-D token array (uint8 for text; a read-only memmap for tokens).
    With `vocab_size`, every token id must be in [0, vocab_size)."""
    if cfg.path == "":
        tokens = _read_files(_stdlib_sources(), cfg.max_bytes)
        where = "the standard library source (data.path is empty)"
    else:
        path = Path(cfg.path)
        if not path.exists():
            raise DataError(f"data.path: no such file or folder {cfg.path!r}")
        is_tokens = is_token_data(cfg)
        if is_tokens:
            tokens = read_token_file(path, cfg.token_dtype, cfg.tokenizer)
        elif path.is_dir():
            files = sorted(p for p in path.glob(cfg.glob) if p.is_file())
            tokens = _read_files(files, cfg.max_bytes)
        else:
            tokens = _read_files([path], cfg.max_bytes)
        where = f"data.path {cfg.path!r}" + (f" (data.glob {cfg.glob!r})" if path.is_dir() else "")
        if not is_tokens:
            _warn_if_not_text(tokens, where)
    if tokens.size == 0:
        raise DataError(f"empty corpus: no data in {where}")
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, where)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Refuse ids outside [0, vocab_size): the embedding would fail on them mid-training. One
    chunked pass over the data, skipped when the element type cannot hold a bad id."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    low, high = 0, 0
    for start in range(0, tokens.size, _CHUNK_TOKENS):
        chunk = tokens[start : start + _CHUNK_TOKENS]
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
    if low < 0:
        raise DataError(f"{where}: token id {low} is negative; token ids must be >= 0")
    if high >= vocab_size:
        raise DataError(
            f"{where}: token id {high} is beyond model.vocab_size {vocab_size} (ids must be < "
            f"{vocab_size}); use data made for this model's vocabulary, or set model.vocab_size "
            f">= {high + 1}"
        )


def non_text_fraction(data: np.ndarray) -> float:
    """The share of invalid UTF-8 and control bytes in up to 16 evenly spread 64 KiB samples."""
    n = data.size
    if n <= _SAMPLES * _SAMPLE_BYTES:
        samples = [data]
    else:
        starts = np.linspace(0, n - _SAMPLE_BYTES, _SAMPLES).astype(np.int64)
        samples = [data[s : s + _SAMPLE_BYTES] for s in starts]
    bad = total = 0
    for sample in samples:
        raw = sample.tobytes()
        valid = raw.decode("utf-8", errors="ignore").encode("utf-8")
        bad += len(raw) - len(valid) + int(np.isin(sample, _CONTROL_BYTES).sum())
        total += len(raw)
    return bad / total if total else 0.0


def _warn_if_not_text(data: np.ndarray, where: str) -> None:
    fraction = non_text_fraction(data)
    if fraction > MAX_NON_TEXT_FRACTION:
        logging.getLogger(LOGGER_NAME).warning(
            "%s: %.0f%% of the sampled bytes are not UTF-8 text (a binary file?); training reads "
            "them as tokens anyway: point data.path at text, or at a token file with "
            "data.format = tokens",
            where,
            100 * fraction,
        )


def _stdlib_sources() -> list[Path]:
    """The running interpreter's stdlib `*.py` files, sorted by relative path; installed packages
    are pruned during the walk (they differ between machines and can be many times larger)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        rel_folder = Path(folder).relative_to(root)
        rel_paths.extend((rel_folder / f).as_posix() for f in files if f.endswith(".py"))
    return [root / rel for rel in sorted(rel_paths)]


def _read_files(files: list[Path], max_bytes: int) -> np.ndarray:
    """Concatenate file bytes; with max_bytes > 0 stop once the cap is reached and cut to it."""
    chunks: list[bytes] = []
    total = 0
    for file in files:
        if 0 < max_bytes <= total:
            break
        data = file.read_bytes()
        chunks.append(data)
        total += len(data)
    joined = b"".join(chunks)
    if max_bytes > 0:
        joined = joined[:max_bytes]
    return np.frombuffer(joined, dtype=np.uint8)


def is_sharded(path: str) -> bool:
    """`path` is a URL (only sharded datasets are read from one), or a local folder holding a
    sharded dataset's index."""
    return "://" in path or (path != "" and (Path(path) / INDEX_NAME).is_file())


def is_token_data(cfg: DataConfig) -> bool:
    """The data is tokens: a mixture, a sharded dataset, or data.path names a token file (by
    data.format, or its suffix when format is auto)."""
    return (
        bool(cfg.sources)
        or is_sharded(cfg.path)
        or cfg.format == "tokens"
        or (cfg.format == "auto" and cfg.path != "" and Path(cfg.path).suffix in _TOKEN_SUFFIXES)
    )


def read_token_file(path: Path, token_dtype: str, tokenizer: str) -> np.ndarray:
    """Memory-map a token file: `.npy` carries its own dtype, a prepared file's sidecar names it
    (and the tokenizer, which must be data.tokenizer), anything else is raw `token_dtype`."""
    if path.is_dir():
        raise DataError(f"data.path {str(path)!r} is a folder; data.format=tokens needs a file")
    sidecar = read_sidecar(path)
    if sidecar is not None:
        check_tokenizer(path, sidecar, load_tokenizer(tokenizer))
        token_dtype = sidecar.dtype
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"data.path {str(path)!r}: expected integer tokens, got {tokens.dtype}")
        return tokens.reshape(-1)
    itemsize = np.dtype(token_dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(
            f"data.path {str(path)!r}: {size} bytes is not a whole number of "
            f"data.token_dtype={token_dtype} tokens ({itemsize} bytes each)"
        )
    if sidecar is not None and size // itemsize != sidecar.num_tokens:
        raise DataError(
            f"data.path {str(path)!r} holds {size // itemsize} tokens but its sidecar says "
            f"{sidecar.num_tokens}; the file is incomplete or was changed: prepare it again"
        )
    if size == 0:
        return np.zeros(0, dtype=token_dtype)
    return np.memmap(path, dtype=token_dtype, mode="r")
