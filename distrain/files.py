"""Writing files into folders others may write too (a shared run dir, a dataset folder on NFS):
a symlink planted at a file's name, at a predictable temporary name or at a subfolder's name
must not make distrain write through it to another file.

- `write_atomic`: the bytes go to a new temporary file (a random name, created with O_EXCL and
  O_NOFOLLOW by `write_new`), then replace the target by rename, which replaces a symlink at the
  target rather than following it. Readers see the old file or the new one, never a part.
- `write_new`: a file that must not exist yet (a lock's private file before its link).
- `write_with`: for a library that writes a file by name itself (torch's trace export): it
  writes into a fresh private folder beside the target, and the file is renamed over the target.
- `open_append`, `open_new`: a log or a stream opened with O_NOFOLLOW.
- `make_dir`: a folder distrain makes inside a run dir (logs/, heartbeat/); one that is a
  symlink is refused, since every file written in it would land where it points.

A symlink that would be written through is refused with one line naming it (`SymlinkRefused`).
A file name read from data (a checkpoint's index, a Hugging Face folder's weight map) is used
only when `plain_file_name`: it stays inside its folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

from distrain.errors import DistrainError

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW


class SymlinkRefused(DistrainError):
    """A file distrain writes is a symlink: someone else placed it there."""


def _refused(path: Path) -> SymlinkRefused:
    return SymlinkRefused(
        f"{path} is a symlink; distrain does not write through links in its folders: "
        "remove it (and check who can write to the folder)"
    )


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except OSError as error:
        # O_NOFOLLOW fails with ELOOP on a link; O_EXCL with EEXIST on any entry, a link too.
        if error.errno == errno.ELOOP or (error.errno == errno.EEXIST and path.is_symlink()):
            raise _refused(path) from None
        raise


def write_new(path: str | Path, data: str | bytes) -> None:
    """Create `path` holding `data` (text is UTF-8); refused when anything is there already."""
    with os.fdopen(_open(Path(path), _CREATE | os.O_EXCL), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is UTF-8) through a fresh temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_new(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_with(path: str | Path, write: Callable[[str], object]) -> None:
    """Replace `path` with the file `write(name)` writes at `name`, a path inside a new folder
    that only this user may write to (mkdtemp, beside `path`), renamed over `path`."""
    path = Path(path)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(str(private / path.name))
        os.replace(private / path.name, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def open_append(path: str | Path) -> IO[str]:
    """`path` opened to append text, line-buffered; a symlink there is refused."""
    return os.fdopen(_open(Path(path), _CREATE | os.O_APPEND), "a", buffering=1)


def open_new(path: str | Path, mode: str = "w") -> IO:
    """`path` opened to write from scratch ("w" or "wb"); a symlink there is refused."""
    return os.fdopen(_open(Path(path), _CREATE | os.O_TRUNC), mode)


def make_dir(root: str | Path, sub: str) -> Path:
    """`root`/`sub` (`sub` may be nested: "profiles/rank0"), each folder below `root` made when
    missing and refused when it is a symlink; `root` (a run dir as the user named it) may be
    one."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    for name in Path(sub).parts:
        path = path / name
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        if path.is_symlink():
            raise _refused(path)
    return path


def plain_file_name(name: object) -> bool:
    """A name that stays inside its folder: no separators, no `..`, nothing hidden in it."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\0")
        and name.isprintable()
    )
