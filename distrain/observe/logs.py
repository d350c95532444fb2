"""Per-rank logging: every rank writes <run_dir>/logs/rank<N>.log; rank 0 also logs to stderr."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "distrain"


def setup_logging(run_dir: Path, rank: int) -> logging.Logger:
    """Configure the `distrain` logger for this process, replacing handlers of an earlier run."""
    logger = logging.getLogger(LOGGER_NAME)
    close_logging(logger)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    file_handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("[distrain] %(message)s"))
        logger.addHandler(console)
    return logger


def close_logging(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
