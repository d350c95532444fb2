"""Per-rank logging: every rank writes <run_dir>/logs/rank<N>.log; rank 0 also logs to stderr,
through the progress bar (tqdm's write) so that a line never lands on the end of the bar.

What the libraries under a rank write goes to its log only: torchft's Python loggers (a
traceback per failed collective of a replica group, which the rank's own one-line event says on
the console) and, in a worker that `distrain train` started, the process's native stderr (file
descriptor 2: gloo's "Connection closed by peer ... GLHF!", torchft's Rust log), while Python's
sys.stderr (the console lines, the progress bar) stays on the console (`native_stderr_to`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from distrain.files import make_dir, open_append

LOGGER_NAME = "distrain"
# `logger.error(..., extra=FILE_ONLY)`: for records stderr already shows another way (a traceback).
FILE_ONLY = {"file_only": True}
LIBRARY_LOGGERS = ("torchft",)
"""Loggers of the libraries a rank runs whose records go to the rank's log only (WARNING and
above): without a handler of their own they would reach the console through logging's last
resort, each rank's copy."""


class _ConsoleHandler(logging.Handler):
    """stderr, written around any live tqdm bar on it (the bar is cleared, the line written, the
    bar redrawn); without a bar it is a plain write."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _NoFollowFileHandler(logging.FileHandler):
    """A FileHandler that refuses a symlink planted at the log's name (distrain/files.py)."""

    def _open(self):  # noqa: ANN202 (logging's own signature)
        return open_append(self.baseFilename)


def setup_logging(run_dir: Path, rank: int) -> logging.Logger:
    """Configure the `distrain` logger for this process, replacing handlers of an earlier run."""
    logger = logging.getLogger(LOGGER_NAME)
    close_logging(logger)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    log_dir = make_dir(run_dir, "logs")
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    file_handler = _NoFollowFileHandler(log_dir / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    if rank == 0:
        console = _ConsoleHandler()
        console.setFormatter(logging.Formatter("[distrain] %(message)s"))
        logger.addHandler(console)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        _drop_file_handlers(library)
        library.setLevel(logging.WARNING)
        library.propagate = False
        library.addHandler(file_handler)
    return logger


def close_logging(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        if _drop_file_handlers(library):
            library.propagate = True  # as before setup_logging


def _drop_file_handlers(library: logging.Logger) -> bool:
    """The rank-log handlers an earlier setup_logging gave a library logger, removed; whether
    there were any."""
    dropped = [h for h in library.handlers if isinstance(h, _NoFollowFileHandler)]
    for handler in dropped:
        library.removeHandler(handler)
    return bool(dropped)


@contextlib.contextmanager
def native_stderr_to(log: Path) -> Iterator[None]:
    """This process's file descriptor 2 appended to `log` while the block runs, and Python's
    sys.stderr kept on the console meanwhile (on a copy of the earlier descriptor 2): what C++
    libraries print (gloo, torchft's Rust log, a crash's last words) reaches the rank's log, not
    the console; the distrain lines, the progress bar and Python's own messages do as before.
    Both restored at the end."""
    sys.stderr.flush()
    console_fd = os.dup(2)
    saved = sys.stderr
    with open_append(log) as appended:
        os.dup2(appended.fileno(), 2)
    console = io.TextIOWrapper(
        os.fdopen(console_fd, "wb", buffering=0, closefd=False),
        encoding=getattr(saved, "encoding", None) or "utf-8",
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    sys.stderr = console
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            console.flush()
        sys.stderr = saved
        os.dup2(console_fd, 2)
        os.close(console_fd)
