"""Writing files into folders others may write too (a shared run dir, a dataset folder on NFS):
a symlink planted at a file's name, at a predictable temporary name or at a subfolder's name
must not make distrain write through it to another file.

- `write_atomic`: the bytes go to a new temporary file (a random name, created with O_EXCL and
  O_NOFOLLOW by `write_new`), then replace the target by rename, which replaces a symlink at the
  target rather than following it. Readers see the old file or the new one, never a part.
- `write_new`: a file that must not exist yet (a lock's private file before its link).
- `write_atomic_new`: as `write_atomic`, but the new file is linked in only where nothing is
  there yet (an existing file, or a link, is refused, never replaced).
- `copy_file`: a file copied from a folder others may write (a tokenizer folder) into one
  distrain writes: the source is opened with O_NOFOLLOW and must be a regular file (a link
  there could point at a secret, a FIFO would hang), the copy is written as `write_atomic`
  writes. Both take `mode` (default 0o644 less the umask), set on the open file before the
  rename (an executable script: 0o755).
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
import stat
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


def write_new(path: str | Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Create `path` holding `data` (text is UTF-8), with `mode` when given; refused when
    anything is there already."""
    with os.fdopen(_open(Path(path), _CREATE | os.O_EXCL), "wb") as f:
        if mode is not None:
            os.fchmod(f.fileno(), mode)
        f.write(data.encode() if isinstance(data, str) else data)


def write_atomic(path: str | Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` (text is UTF-8), with `mode` when given, through a fresh
    temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_new(tmp, data, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic_new(path: str | Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Create `path` holding `data`, whole or not at all (a temporary file as `write_atomic`
    writes it, then a hard link at `path`); FileExistsError when anything is there already."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_new(tmp, data, mode=mode)
        os.link(tmp, path, follow_symlinks=False)
    finally:
        tmp.unlink(missing_ok=True)


def read_plain(path: str | Path) -> bytes:
    """The bytes of `path`, refused in one line unless it is a regular file itself (not a
    link, a FIFO, a device)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _not_copied(path) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _not_copied(path)
        return f.read()


def copy_file(source: str | Path, target: str | Path, *, mode: int | None = None) -> None:
    """Copy `source`, which must be a regular file itself (`read_plain`), to `target` as
    `write_atomic` writes (a link at `target` is replaced, not followed)."""
    write_atomic(target, read_plain(source), mode=mode)


def _not_copied(path: Path) -> SymlinkRefused:
    return SymlinkRefused(
        f"{path} is a symlink or not a regular file; distrain copies only regular files from "
        "folders others may write: put the file itself there"
    )


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
