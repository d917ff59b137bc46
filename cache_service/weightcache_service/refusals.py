"""The daemon's log of refused requests: who asked, for what, and why not; rate-limited.

A worker that falls back to disk says why in its own log; this is the daemon's side, so
that an operator reading only the daemon's log sees every refusal: the reason, the model
or checkpoint asked for, the differing fingerprint components, the peer as the worker
describes itself. Refusals of one kind (reason and subject) are logged at most once per
:data:`INTERVAL` seconds; the next line of that kind counts those left out
(``suppressed``), so a fleet of workers falling back for one cause writes a line every
few seconds, not one per worker.

Levels: ``warning``, except the refusals the worker asks again after: a miss of an
Acquire by file identity (``MODEL_NOT_FOUND`` or ``FINGERPRINT_MISMATCH`` with
``match=files``), which the SDK follows with an Acquire by fingerprint, as the protocol
prescribes (docs/protocol.md, "Acquire by file identity"), and a ``MODEL_LOADING`` of an
Acquire with ``asks_again_if_loading``: ``debug``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("weightcache.daemon")

#: Seconds between two lines of one kind of refusal.
INTERVAL = 10.0
#: Kinds remembered at once; the oldest are forgotten first (bounds the daemon's memory
#: against requests that vary the path on purpose).
MAX_KINDS = 1024


class RefusalLog:
    """Logs refusals, one line per kind per :data:`INTERVAL` seconds.

    Args:
        clock: monotonic seconds (injected by tests).
        interval: seconds between two lines of one kind.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, interval: float = INTERVAL
    ) -> None:
        self._clock = clock
        self._interval = interval
        #: kind -> (time of its last line, refusals left out since).
        self._kinds: dict[tuple[str, ...], tuple[float, int]] = {}

    def refused(
        self,
        rpc: str,
        reason: str,
        detail: str,
        *,
        debug: bool = False,
        peer: Callable[[], dict[str, Any]] | None = None,
        **fields: Any,
    ) -> bool:
        """Log one refusal of ``rpc`` (``Acquire``, ``Evict``...) for ``reason`` with
        ``fields`` (``path``, ``fingerprint``, ``model``, ``components``...) and what
        ``peer()`` says of the caller (called only when a line is written), unless a line
        of the same kind (rpc, reason, model, path and fingerprint) was written less than
        the interval ago. Returns whether a line was written."""
        kind = (rpc, reason, *(str(fields.get(k, "")) for k in ("model", "path", "fingerprint")))
        now = self._clock()
        last, left_out = self._kinds.get(kind, (float("-inf"), 0))
        if now - last < self._interval:
            self._kinds[kind] = (last, left_out + 1)
            return False
        self._kinds.pop(kind, None)
        if len(self._kinds) >= MAX_KINDS:
            del self._kinds[next(iter(self._kinds))]
        self._kinds[kind] = (now, 0)
        emit = log.debug if debug else log.warning
        if peer is not None:
            fields.update(peer())
        emit("refused", rpc=rpc, reason=reason, error=detail, suppressed=left_out, **fields)
        return True
