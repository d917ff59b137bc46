"""Capturing what the SDK logs (standard :mod:`logging`, logger ``weightcache``) as event
dicts: ``{"event": ..., "log_level": "warning", **fields}``, the shape structlog's
``capture_logs`` gives, for assertions on exact fields."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

from weightcache._log import LOGGER


class _ListHandler(logging.Handler):
    def __init__(self, out: list[MutableMapping[str, Any]]) -> None:
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "wc_fields", {})
        event = getattr(record, "wc_event", record.getMessage())
        self.out.append({"event": event, "log_level": record.levelname.lower(), **fields})


@contextlib.contextmanager
def capture_sdk_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect every record of the ``weightcache`` logger (DEBUG and up) while inside;
    the logger's level is restored on exit."""
    logs: list[MutableMapping[str, Any]] = []
    logger = logging.getLogger(LOGGER)
    handler = _ListHandler(logs)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield logs
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
