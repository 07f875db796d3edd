"""`get_logger`: upstream's ``twinkle`` logger, quiet on all but the local master rank."""

from __future__ import annotations

import logging
import os

from twinkle.platform import Platform

_FORMAT = logging.Formatter(
    "[%(asctime)s][%(levelname)s:%(name)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"
)


def _parse_level(level: int | str | None) -> int:
    """A level from an int, a name ('DEBUG') or a numeric string; INFO when unreadable."""
    if isinstance(level, int):
        return level
    if isinstance(level, str):
        level = level.strip().upper()
        if level.isdigit():
            return int(level)
        value = getattr(logging, level, None)
        if isinstance(value, int):
            return value
    return logging.INFO


def get_logger(
    log_file: str | None = None,
    log_level: int | str | None = None,
    file_mode: str = "w",
    only_local_master: bool = True,
) -> logging.Logger:
    """The ``twinkle`` logger: to stderr, and to `log_file` when given.

    `log_level` defaults to ``LOG_LEVEL`` (INFO). With `only_local_master`, ranks other than
    local rank 0 log errors only, so a multi-process run prints each message once. The logger
    does not propagate to the root logger (torch's DDP attaches a handler there). Calling again
    adds a file handler for a new `log_file` and resets the level.
    """
    level = _parse_level(os.getenv("LOG_LEVEL", "INFO") if log_level is None else log_level)
    if only_local_master and not Platform.is_local_master():
        level = logging.ERROR
    logger = logging.getLogger("twinkle")
    logger.propagate = False
    if not any(type(h) is logging.StreamHandler for h in logger.handlers):
        stream = logging.StreamHandler()
        stream.setFormatter(_FORMAT)
        logger.addHandler(stream)
    if log_file is not None:
        path = os.path.abspath(log_file)
        if not any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
            handler = logging.FileHandler(path, file_mode)
            handler.setFormatter(_FORMAT)
            logger.addHandler(handler)
    for handler in logger.handlers:
        handler.setLevel(level)
    logger.setLevel(level)
    return logger
