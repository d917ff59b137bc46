"""Fair shares of the event loop for KeepAlive work, across every stream (issue 37, item 12).

The daemon serves every RPC on one asyncio event loop. A KeepAlive message names up to
4 096 lease ids, and renewing and encoding them is Python work per id (about 40 ms per
message on a loaded 2-CPU machine, most of it making the statuses and their messages):
done in one piece per message, a flood of many streams kept the loop busy for seconds at
a time, and other clients waited behind it (another client's ``GetServerInfo``: p50
425 ms, max 7.8 s with 200 streams x 4 096 ids).

:class:`FairQueue` runs that work one message at a time daemon-wide, in batches of at most
:data:`BATCH_IDS` ids, and serves next the waiting message whose stream (a *flow*) renewed
the fewest ids lately, this message's included: each flow's ids, decaying by half every
:data:`HALF_LIFE` seconds (least attained service, as in CPU schedulers that favour tasks
which used little of the CPU lately); a message's usage goes on decaying while it waits
(:func:`_priority`), so none waits for ever behind streams that keep flooding, and an
answer goes before a message of the same usage. A stream that sends a few ids every TTL/3 (a
worker) is thus served right after the message in progress, however many streams another
peer floods with, and flooding streams share what is left in turn. (Fair queuing by start
tags, tried first, made a light message wait behind one message of every flooding stream:
up to 16 s in ``bench/keepalive_flood.py``.) A message is renewed and its answer encoded
in the same turn (the servicer), so what waits in a stream's outbox is an encoded answer,
not thousands of status objects; an answer the cache pushes (a revocation, a hand-over)
takes a turn of cost 0, before messages of the same usage. Between two
batches the loop runs everything else that is ready, and it rests (serves others) at
least as long as the last batch took, so KeepAlive work takes at most :data:`SHARE` of
the loop's time. One message at a time also keeps what is in progress small: one
message's statuses, not every stream's.

grpcio does not say which connection or process a call comes from on the Unix socket
(``context.peer()`` is ``unix:`` for every one), so shares are per stream, not per peer:
what a peer with many streams gains is more of the KeepAlive share, never more than it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager

#: Lease ids renewed (or encoded) in one piece of the event loop's time; a message names at
#: most 4 096 (``core.protocol.MAX_LEASES_PER_REQUEST``): 16 batches.
BATCH_IDS = 256
#: The most of the event loop's time KeepAlive work takes while others wait for it.
SHARE = 0.5
#: Seconds in which the ids a flow renewed count half as much.
HALF_LIFE = 1.0


class FairQueue:
    """One stream's KeepAlive work at a time, in batches, the stream that renewed the fewest
    ids lately first.

    Args:
        share: the most of the loop's time the batches take (0 < share <= 1): after a
            batch of ``t`` seconds the next one starts ``t * (1 - share) / share`` later.
        clock: monotonic seconds, for the usage's decay (injectable for tests).

    Raises:
        ValueError: ``share`` outside (0, 1].
    """

    def __init__(self, share: float = SHARE, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self._clock = clock
        self._rest = (1 - share) / share
        #: Per flow: the ids it was charged, decayed to the time beside them, and the
        #: ids of its last message.
        self._usage: dict[Hashable, tuple[float, float, int]] = {}
        self._waiting: list[tuple[float, int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._busy = False

    @asynccontextmanager
    async def turn(self, flow: Hashable, cost: int) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """Wait for ``flow``'s turn to do work of ``cost`` ids (0: work already charged,
        the answer to a message renewed: see :meth:`_charge`), hold it for the block, then
        pass it on. The block awaits the function it is given between two batches of at most
        :data:`BATCH_IDS` ids: the loop then rests (serves everything else) for as long as
        its share asks.

        Raises:
            asyncio.CancelledError: cancelled while waiting (the turn is passed on).
        """
        key = self._charge(flow, cost)
        if self._busy or self._waiting:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (_priority(key, self._clock()), 1 if cost else 0, next(self._order), waiter)
            heapq.heappush(self._waiting, entry)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._next()  # handed the turn, then cancelled: pass it on
                raise
        else:
            self._busy = True
        began = time.perf_counter()

        async def pause() -> None:
            nonlocal began
            await asyncio.sleep((time.perf_counter() - began) * self._rest)
            began = time.perf_counter()

        try:
            yield pause
        finally:
            took = time.perf_counter() - began
            asyncio.get_running_loop().call_later(took * self._rest, self._next)

    def forget(self, flow: Hashable) -> None:
        """Drop what is kept of a flow that ended (its usage)."""
        self._usage.pop(flow, None)

    def _charge(self, flow: Hashable, cost: int) -> float:
        """Charge ``flow`` ``cost`` ids; its usage with them (decayed to now): a new stream
        that names thousands of ids waits behind one that names a few. With ``cost`` 0 (an
        answer), its usage without the ids last charged: the answer to a flooding stream's
        message comes after light streams' renewals, before other flooding messages."""
        now = self._clock()
        used, at, last = self._usage.get(flow, (0.0, now, 0))
        used *= math.pow(0.5, (now - at) / HALF_LIFE)
        if not cost:
            return max(0.0, used - last)
        self._usage[flow] = (used + cost, now, cost)
        return used + cost

    def _next(self) -> None:
        """Hand the turn to the waiting message of the least usage, if any."""
        while self._waiting:
            *_, waiter = heapq.heappop(self._waiting)
            if not waiter.done():  # not cancelled meanwhile
                waiter.set_result(None)
                return
        self._busy = False


def _priority(key: float, now: float) -> float:
    """A message's place in the queue, given its flow's usage ``key`` when queued at clock
    ``now``: the usage goes on decaying while the message waits (a waiting flow renews
    nothing). At any later time ``t``, ``key * 2 ** -((t - now) / HALF_LIFE)`` orders
    waiters as ``log2(key) + now / HALF_LIFE`` does, whatever ``t``, so the heap keeps its
    order: a stream that named many ids is served once its usage has decayed below what
    the flooding streams keep adding (at most ``log2(key / BATCH_IDS)`` half-lives later),
    never starved by them. A usage of 0 goes first."""
    return now / HALF_LIFE + math.log2(key) if key > 0 else -math.inf
