"""The server's own log: loads, HTTP requests, errors and timings, in a rotating file in the data folder."""

from __future__ import annotations

import logging
from collections import deque
from logging.handlers import RotatingFileHandler
from pathlib import Path

from setup_logic.store import Store

LOG_FILE = "logs/strata-mcp.log"
MAX_BYTES = 2_000_000  # per file; with BACKUPS old files, a few MB in all
BACKUPS = 3


def log_path(store: Store) -> Path:
    return store.resolve(LOG_FILE)


def open_log(store: Store) -> logging.Logger:
    """The logger of this data folder (one per folder, so two runtimes in one process keep separate logs)."""
    path = log_path(store)
    logger = logging.getLogger(f"strata_mcp.log.{path}")
    if not logger.handlers:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # stderr of an MCP server is the client's; the file is the record
    return logger


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of the log (fewer when it is shorter; none when there is no log yet)."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
