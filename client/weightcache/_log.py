"""The SDK's logging: standard :mod:`logging`, logger ``weightcache`` (and children).

The SDK runs inside the host application, so its records go wherever the application's
handlers and levels send them (nothing is printed when it configured nothing but the
default ``lastResort`` handler, which shows warnings on stderr). Each record's message is
the event and its fields as ``key=value`` text; the same are kept on the record as
``record.wc_event`` (str) and ``record.wc_fields`` (dict), for handlers that want them
structured (``weightcache.testing`` captures them so).
"""

from __future__ import annotations

import logging
from typing import Any

LOGGER = "weightcache"


class EventLogger:
    """Logs an event with fields, structlog-style, through a standard logger.

    Args:
        name: the standard logger's name (``weightcache`` or below).
    """

    def __init__(self, name: str = LOGGER) -> None:
        self.logger = logging.getLogger(name)

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if not self.logger.isEnabledFor(level):
            return
        text = " ".join(
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items()
        )
        self.logger.log(
            level,
            "%s%s%s",
            event,
            " " if text else "",
            text,
            extra={"wc_event": event, "wc_fields": fields},
            stacklevel=3,
        )

    def debug(self, event: str, **fields: Any) -> None:
        """Log ``event`` at DEBUG."""
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log ``event`` at INFO."""
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log ``event`` at WARNING."""
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ERROR."""
        self._log(logging.ERROR, event, fields)


def get_logger(name: str = LOGGER) -> EventLogger:
    """The event logger over the standard logger ``name``."""
    return EventLogger(name)
