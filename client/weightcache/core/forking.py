"""Holding the SDK's gRPC calls off a ``fork()``.

gRPC cannot fork while other threads are inside it: its fork handlers then skip
("Other threads are currently calling into gRPC, skipping fork() handlers"), and the
child inherits a poller and descriptors in mid-call; such children hung, aborted or
segfaulted in gRPC's poller, or failed with "Wrong file descriptor generation" (issue 27).
Model workers are forked (multiprocessing, gunicorn, torch's DataLoader), often while
other threads of the parent load weights.

So every SDK call into gRPC runs inside :func:`calling`, and a handler registered with
``os.register_at_fork`` waits, before each fork, until no call is in flight (at most
:data:`FORK_WAIT` seconds) and starts no new one until the fork is done. A call that has
not ended by then (a daemon that does not answer) does not hold the fork for longer: the
child is marked (:func:`forked_mid_call`) and its SDK does not touch the inherited gRPC
state, loading from disk with ``DAEMON_UNAVAILABLE`` instead (:func:`check_child`).

gRPC's own fork handlers are needed too (``GRPC_ENABLE_FORK_SUPPORT=1``, which importing
``weightcache`` before grpc sets): without them a child forked after its parent opened a
channel may not use gRPC either (same reason and fallback). Measured (60 children forked
while 4 threads of the parent load and release in a loop): before, 57 cache, 2
``DAEMON_UNAVAILABLE`` ("Wrong file descriptor generation", a deadline), 1 SIGSEGV; this
gate without fork support: 7 SIGABRT in gRPC's epoll1 poller; fork support without
this gate: the run did not end in 20 minutes; both: 60 of 60 from the cache.

gRPC's own child handler must not touch the parent's channels, though: it cancels their
calls under each channel's lock, which a thread of the parent (the KeepAlive stream's
reader, opening or renewing) may hold at the fork; held by no one in the child, the child
hung inside ``os.fork`` (issue 37, item 1). So the SDK's handler, registered first
(``import weightcache``) and so run first in the child, takes the SDK's channels out of
gRPC's list and keeps them, untouched, for the child's life (:meth:`_ForkGate.
abandon_channels`); the child opens channels of its own. Measured with
``tests/fork_churn.py`` (children forked right after a load, while a stream opens or
renews): before, about 1 child in 40-60 hung; after, 100 of 100 loaded from the cache.

Covered: forks through Python (``os.fork``, ``multiprocessing``'s ``fork`` start method,
and the libraries built on them); a fork from C that bypasses Python's fork hooks is not.
The KeepAlive stream is long-lived: between its messages it is not a call in flight
(gRPC's own fork handlers quiesce its polling thread); each message it sends is.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from weightcache.core.errors import DaemonUnavailableError

#: Most seconds a fork waits for the SDK's calls in flight (each is bounded by its own
#: deadline, 10 s for an Acquire).
FORK_WAIT = 15.0


class _ForkGate:
    """The calls in flight, and whether a fork is under way (one per process)."""

    def __init__(self) -> None:
        self.state = threading.Condition()
        self.in_flight = 0
        self.forking = False
        self.mid_call_child = False
        #: This process opened a gRPC channel (:func:`opened_channel`).
        self.used_grpc = False
        #: Why a child must not touch the gRPC state it inherited, or None.
        self.unusable: str | None = None
        #: Per thread: how many calls it is inside (a fork waits for the others' only).
        self.depth = threading.local()
        #: The gRPC channels this process opened (:func:`opened_channel`).
        self.channels: weakref.WeakSet[Any] = weakref.WeakSet()
        #: In a child: the channels its parent opened, kept referenced and never touched.
        self.inherited: list[Any] = []

    def own(self) -> int:
        return int(getattr(self.depth, "value", 0))

    @contextmanager
    def calling(self) -> Iterator[None]:
        depth = self.own()
        with self.state:
            # A thread already inside a call (re-entrant use) must not wait for a fork.
            while self.forking and depth == 0:
                self.state.wait()
            self.in_flight += 1
        self.depth.value = depth + 1
        try:
            yield
        finally:
            self.depth.value = depth
            with self.state:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.state.notify_all()

    def before_fork(self) -> None:
        own = self.own()
        deadline = time.monotonic() + FORK_WAIT
        with self.state:
            self.forking = True
            while self.in_flight > own and (left := deadline - time.monotonic()) > 0:
                self.state.wait(left)

    def after_fork_in_parent(self) -> None:
        with self.state:
            self.forking = False
            self.state.notify_all()

    def after_fork_in_child(self) -> None:
        self.abandon_channels()
        own = self.own()
        self.mid_call_child = self.mid_call_child or self.in_flight > own
        if self.unusable is None and self.mid_call_child:
            self.unusable = (
                "this process was forked while its parent's SDK was inside a gRPC call "
                f"(for over {FORK_WAIT:.0f} s)"
            )
        if self.unusable is None and self.used_grpc and not _fork_support():
            self.unusable = (
                "this process was forked after its parent used gRPC, and gRPC's fork "
                "support is off (set GRPC_ENABLE_FORK_SUPPORT=1 before grpc is imported, "
                "or import weightcache first)"
            )
        # The condition's lock may be held by a parent thread that does not exist here.
        self.state = threading.Condition()
        self.in_flight = own
        self.forking = False

    def abandon_channels(self) -> None:
        """Hide the parent's channels from gRPC's own child handler, and keep them.

        gRPC's handler cancels the calls of every channel it knows, under each channel's
        lock; a thread of the parent (the KeepAlive stream's reader, the SDK's calls)
        may have held that lock at the fork, and it stays held here by no one: the child
        hung inside ``os.fork`` (issue 37, item 1). Closing or collecting the channels
        would take the same lock (``Channel.close``, ``_ChannelCallState.__del__``), so
        they are kept referenced for the life of the child and never used: the child
        opens its own (``rpc.shared``: its registry is emptied after a fork).
        """
        channels = list(self.channels)
        self.inherited.extend(channels)
        self.channels = weakref.WeakSet()
        if not channels:
            return
        cygrpc = _cygrpc()
        unregister = getattr(cygrpc, "fork_unregister_channel", None)
        for channel in channels:
            if unregister is not None:
                unregister(channel)


_gate = _ForkGate()
os.register_at_fork(
    before=_gate.before_fork,
    after_in_parent=_gate.after_fork_in_parent,
    after_in_child=_gate.after_fork_in_child,
)


@contextmanager
def calling() -> Iterator[None]:
    """Run one call into gRPC: not while a fork is under way, and a fork waits for it.

    Raises:
        DaemonUnavailableError: this process was forked while a call was in flight
            (:func:`check_child`).
    """
    check_child()
    with _gate.calling():
        yield


def check_child() -> None:
    """Refuse gRPC in a child forked while its parent's SDK was mid-call.

    Raises:
        DaemonUnavailableError: this process is such a child.
    """
    if _gate.unusable is not None:
        raise DaemonUnavailableError(
            f"{_gate.unusable}: its gRPC state is unusable, so it does not connect to the daemon"
        )


def opened_channel(channel: Any) -> None:
    """Note that this process opened ``channel`` (a ``grpc.Channel``): a child forked from
    it may not use gRPC without gRPC's fork support, and never uses ``channel``
    (:meth:`_ForkGate.abandon_channels`)."""
    _gate.used_grpc = True
    _gate.channels.add(channel)


def _cygrpc() -> Any:
    try:  # a private module: a later grpcio may move it
        return importlib.import_module("grpc._cython.cygrpc")
    except ImportError:
        return None


def _fork_support() -> bool:
    cygrpc = _cygrpc()
    return cygrpc is not None and bool(cygrpc.is_fork_support_enabled())


def forked_mid_call() -> bool:
    """Whether this process was forked while its parent's SDK was mid-call."""
    return _gate.mid_call_child
