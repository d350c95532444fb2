"""Writing files into folders others may write too (a shared run dir, a dataset folder on NFS):
a symlink planted at a file's name, or at a predictable temporary name, must not make distrain
write through it to another file.

- `write_atomic`: the bytes go to a new temporary file (a random name, created with O_EXCL and
  O_NOFOLLOW), then replace the target by rename, which replaces a symlink at the target rather
  than following it. Readers see the old file or the new one, never a part.
- `open_append`, `open_new`: a log or a stream opened with O_NOFOLLOW: a symlink at the name is
  refused with one line naming it.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path
from typing import IO

from distrain.errors import DistrainError

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW


class SymlinkRefused(DistrainError):
    """A file distrain writes is a symlink: someone else placed it there."""


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SymlinkRefused(
                f"{path} is a symlink; distrain does not write through links in its folders: "
                "remove it (and check who can write to the folder)"
            ) from None
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is UTF-8) through a fresh temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = _open(tmp, _CREATE | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_append(path: str | Path) -> IO[str]:
    """`path` opened to append text, line-buffered; a symlink there is refused."""
    return os.fdopen(_open(Path(path), _CREATE | os.O_APPEND), "a", buffering=1)


def open_new(path: str | Path, mode: str = "w") -> IO:
    """`path` opened to write from scratch ("w" or "wb"); a symlink there is refused."""
    return os.fdopen(_open(Path(path), _CREATE | os.O_TRUNC), mode)
