"""One rank's part of a checkpoint save, as the ranks exchange it to settle the save: written,
or failed with a cause, and whether the cause was a full disk (ENOSPC/EDQUOT anywhere in the
exception chain, which torch.save reports only as "unexpected pos")."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

from distrain.checkpoint.storage import HashingWriter

MB = 1 << 20
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def mb_text(num_bytes: int) -> str:
    """MiB with one decimal, or three significant digits below 0.1."""
    mb = num_bytes / MB
    return f"{mb:.1f}" if mb >= 0.1 else f"{mb:.3g}"


@dataclass(frozen=True)
class Attempt:
    """One rank's part of a save: None error when its files and record are written."""

    error: str | None = None
    disk_full: bool = False
    planned_bytes: int = 0
    free_bytes: int | None = None
    """Free space where this rank writes, measured once its part failed (local storage only):
    the figure a full disk report needs, since the space may have gone during the save."""


def disk_full(error: BaseException | None, writer: HashingWriter) -> bool:
    """Whether the write failed for want of space: an ENOSPC/EDQUOT raised by a write, or
    anywhere in the exception chain (torch.save reports it as "unexpected pos")."""
    seen: list[BaseException] = [writer.write_error] if writer.write_error else []
    while error is not None:
        seen.append(error)
        if isinstance(error, CheckpointException):
            seen += [f[0] for f in error.failures.values() if isinstance(f[0], BaseException)]
        error = error.__cause__ or error.__context__
    return any(isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS for e in seen)
