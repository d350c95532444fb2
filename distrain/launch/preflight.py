"""Cheap checks of the places a run reads and writes, made by `distrain train` before it starts
any worker: the data path exists (and a prepared token file's sidecar names data.tokenizer, and
document masking has boundaries to read), the run directory and a local checkpoint directory can
take files (a probe file written and deleted), and an object-store URL's filesystem is installed.

Cheap means no data is read (a corpus may be gigabytes) and nothing is left behind: a folder
that does not exist yet is not created, its nearest existing parent is probed instead. Reading the
data (token ids, text or binary) is the data package's job, when the workers open it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fsspec.core import split_protocol
from fsspec.registry import get_filesystem_class, known_implementations

from distrain.checkpoint.checkpointer import checkpoint_storage
from distrain.config.schema import Config
from distrain.data.corpus import is_token_data
from distrain.data.documents import boundaries_file, no_boundaries_message
from distrain.data.tokenizer import load_tokenizer
from distrain.data.tokfile import check_tokenizer, read_sidecar
from distrain.errors import ConfigError

_LOCAL_PROTOCOLS = (None, "file", "local")


def preflight(cfg: Config) -> None:
    """Raise ConfigError (one line naming the field, the path and the cause) for the first
    problem found."""
    if cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path: no such file or folder {cfg.data.path!r}")
    if is_token_data(cfg.data) and Path(cfg.data.path).is_file():
        sidecar = read_sidecar(Path(cfg.data.path))  # a small JSON file: cheap to read here
        if sidecar is not None:
            check_tokenizer(Path(cfg.data.path), sidecar, load_tokenizer(cfg.data.tokenizer))
    if cfg.data.document_masking and cfg.data.eos_id is None and boundaries_file(cfg.data) is None:
        raise ConfigError(no_boundaries_message(cfg.data))
    check_writable("run.dir", Path(cfg.run.dir))
    protocol, _ = split_protocol(cfg.checkpoint.dir)
    if protocol in _LOCAL_PROTOCOLS:
        field = "checkpoint.dir" if cfg.checkpoint.dir else "run.dir (its checkpoints/ folder)"
        check_writable(field, Path(checkpoint_storage(cfg).root))
    else:
        check_filesystem_installed("checkpoint.dir", cfg.checkpoint.dir, protocol)


def check_writable(field: str, path: Path) -> None:
    """`path` is a folder, or can become one, where this process can create and delete files."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        problem = (
            "is a file, not a folder"
            if existing == path
            else f"cannot be created: {str(existing)!r} is a file"
        )
        raise ConfigError(f"{field} {str(path)!r} {problem}; choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".distrain-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{field} {str(path)!r} is not writable ({e.strerror} creating a file in "
            f"{str(existing)!r}); choose a writable folder"
        ) from None


def check_filesystem_installed(field: str, url: str, protocol: str) -> None:
    """fsspec can open `protocol://` URLs here: its implementation package is installed."""
    try:
        get_filesystem_class(protocol)
    except ImportError:
        package = known_implementations[protocol]["class"].split(".")[0]
        raise ConfigError(
            f"{field} {url!r} needs the {package} package for {protocol}:// URLs; "
            f"pip install {package}"
        ) from None
    except ValueError:
        raise ConfigError(
            f"{field} {url!r}: unknown protocol {protocol}://; use a local folder or an fsspec "
            "URL such as s3://bucket/run"
        ) from None
