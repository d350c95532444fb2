"""Per-rank logging: every rank writes <run_dir>/logs/rank<N>.log; rank 0 also logs to stderr,
through the progress bar (tqdm's write) so that a line never lands on the end of the bar."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

from distrain.files import make_dir, open_append

LOGGER_NAME = "distrain"
# `logger.error(..., extra=FILE_ONLY)`: for records stderr already shows another way (a traceback).
FILE_ONLY = {"file_only": True}


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
    return logger


def close_logging(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
