"""Corpus readers: turn `data.path` into one flat array of tokens (bytes of text, or a token file).

Text is read as raw bytes (the byte tokenizer's tokens) and concatenated in sorted path order, so
the same files give the same stream on every machine. Token files are memory-mapped, not copied.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from distrain.config import DataConfig
from distrain.errors import DistrainError

_SKIPPED_DIRS = ("site-packages", "dist-packages")
_TOKEN_SUFFIXES = (".bin", ".npy")


class DataError(DistrainError, ValueError):
    """Data that cannot be used for training; the message names the config field to change."""


def read_corpus(cfg: DataConfig) -> np.ndarray:
    """The whole corpus as a 1-D token array (uint8 for text; a read-only memmap for tokens)."""
    if cfg.path == "":
        tokens = _read_files(_stdlib_sources(), cfg.max_bytes)
        where = "the standard library source (data.path is empty)"
    else:
        path = Path(cfg.path)
        if not path.exists():
            raise DataError(f"data.path: no such file or folder {cfg.path!r}")
        is_tokens = cfg.format == "tokens" or (
            cfg.format == "auto" and path.suffix in _TOKEN_SUFFIXES
        )
        if is_tokens:
            tokens = _read_token_file(path, cfg.token_dtype)
        elif path.is_dir():
            files = sorted(p for p in path.glob(cfg.glob) if p.is_file())
            tokens = _read_files(files, cfg.max_bytes)
        else:
            tokens = _read_files([path], cfg.max_bytes)
        where = f"data.path {cfg.path!r}" + (f" (data.glob {cfg.glob!r})" if path.is_dir() else "")
    if tokens.size == 0:
        raise DataError(f"empty corpus: no data in {where}")
    return tokens


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


def _read_token_file(path: Path, token_dtype: str) -> np.ndarray:
    """Memory-map a token file: `.npy` carries its own dtype, anything else is raw `token_dtype`."""
    if path.is_dir():
        raise DataError(f"data.path {str(path)!r} is a folder; data.format=tokens needs a file")
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
    if size == 0:
        return np.zeros(0, dtype=token_dtype)
    return np.memmap(path, dtype=token_dtype, mode="r")
