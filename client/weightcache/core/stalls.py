"""How long a loop of this process was not scheduled, and a clock that stops meanwhile.

A loop that expects to run again within some seconds (an event loop's periodic task, a
thread's timed wait) tells a :class:`StallWatch` so with :meth:`StallWatch.beat`. When it
runs later than that (plus :data:`TOLERANCE`), the excess is a *stall*: the process, or
that thread, was descheduled (an overloaded host, SIGSTOP, swapping) or the loop was kept
busy. :meth:`StallWatch.now` is the injected clock less every stall so far, the one in
progress included: it stands still from the moment a beat is overdue until the loop runs
again.

Leases are timed on that clock (issue 27, item 12). The daemon's lease table uses its
event loop's watch, so a daemon that was starved does not expire leases whose renewals
were queued behind it (they are read once it runs again); a worker's keepalive thread uses
its own, so it does not blame the daemon for the time it was not scheduled itself (it
renews at once and believes the daemon's answer). See docs/leases.md, "Under load".

All times are seconds from the injected clock (``time.monotonic`` unless a test gives
one). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]

#: Seconds a beat may come late before the lateness counts as a stall: timer slack,
#: a garbage collection, the scheduler's ordinary latency.
TOLERANCE = 0.05


class StallWatch:
    """Measures how long a loop was not scheduled beyond the period it announced.

    Args:
        clock: monotonic seconds (injectable for tests).
        tolerance: seconds of lateness that do not count as a stall.
    """

    def __init__(self, clock: Clock = time.monotonic, tolerance: float = TOLERANCE) -> None:
        self._clock = clock
        self._tolerance = tolerance
        self._lock = threading.Lock()
        #: Clock reading by which the next beat is expected (None: none is).
        self._due: float | None = None
        self._stalled = 0.0
        self._longest = 0.0
        self._count = 0

    def beat(self, next_within: float | None) -> float:
        """The loop runs now, and expects to run again within ``next_within`` seconds
        (None: it does not know, e.g. it is about to block on I/O; no stall is counted
        until its next beat).

        Returns:
            The stall this beat ended, in seconds: how much later than expected (and
            :data:`TOLERANCE`) it came; 0.0 when on time or when no beat was expected.
        """
        now = self._clock()
        with self._lock:
            late = 0.0 if self._due is None else max(0.0, now - self._due)
            if late > 0.0:
                self._stalled += late
                self._longest = max(self._longest, late)
                self._count += 1
            self._due = None if next_within is None else now + next_within + self._tolerance
        return late

    def now(self) -> float:
        """The clock less every stall so far, including the one in progress (seconds).

        Never decreases; stands still while a beat is overdue.
        """
        now = self._clock()
        with self._lock:
            pending = 0.0 if self._due is None else max(0.0, now - self._due)
            return now - self._stalled - pending

    @property
    def stalled(self) -> float:
        """Seconds of stalls ended so far (the one in progress not included)."""
        with self._lock:
            return self._stalled

    @property
    def longest(self) -> float:
        """The longest stall ended so far, in seconds."""
        with self._lock:
            return self._longest

    @property
    def count(self) -> int:
        """How many beats came late."""
        with self._lock:
            return self._count
