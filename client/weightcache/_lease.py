"""Client-side leases: one KeepAlive stream per process and daemon, and the loss policy.

A lease is renewed every ``ttl / 3`` seconds. It is *valid* for ``2 * ttl / 3`` seconds
after the daemon last acknowledged it, a window shorter than the daemon's TTL, so the
client gives up on a lease before the daemon could free the memory under it. A lease is
lost when that window passes without an acknowledgement, when the stream breaks (the
daemon died), when the daemon answers NOT_FOUND or from a new instance (it restarted), or
when it pushes REVOKING.

A daemon stopping for a restart with a hand-over says so on the stream
(``KeepAliveResponse.hand_over``) before it ends it: the session then reconnects to the same
socket every :data:`RECONNECT_INTERVAL` seconds while its leases are valid, and renews them
there; the successor answers ACTIVE (from a new instance) for the leases it adopted, which
live on under the same ids, and NOT_FOUND for the others, which are lost.

When the daemon pushes REVOKING (a forced evict, or a drain at SIGTERM), the lease's
``on_revoke`` policy decides, on the keepalive thread:

- ``"keep"`` (default): when the REVOKING status carries no deadline (shared memory: the
  daemon has dropped the model and unlinked its segment, and frees nothing under a
  mapping), keep the mapping as it is: no copy, no new memory; its bytes cannot change
  (the segment is read-only to workers and was freed only by unlink). The lease is still
  renewed, so that the daemon counts the unlinked bytes as mapped, and released at
  ``close()``, when this process unmaps them; it can no longer be lost (a broken stream
  or a NOT_FOUND ends it silently). With a deadline (a GPU, where the memory dies with
  the daemon), as ``"copy"``.
- ``"copy"``: make the mapped pages private to this process (every view keeps its
  address and bytes), release the lease, and carry on. Costs one copy of the arena per
  worker; the GPU's behaviour, available on CPU for who wants its own pages.
- ``"raise"`` / ``"exit"``: treat the lease as lost (below), whatever its loss policy says
  for ``"raise"`` versus ``"exit"`` respectively.

Policies, applied once, on the keepalive thread, when a lease is lost (the
``on_lease_lost`` callback, if any, runs first under each of them):

- ``"raise"``: :class:`LeaseLostError` from the next ``LoadedWeights.tensors`` access.
- ``"exit"``: log and ``os._exit(75)`` (EX_TEMPFAIL), so that a supervisor restarts the
  worker. Recommended where the memory may vanish (CUDA zero-copy).
- ``"ignore"``: log and carry on. The default for shared memory: a mapped arena stays
  readable, with the same bytes, after the daemon exits or frees it (mmap(2): a mapping
  outlives the unlinked file), so losing the lease loses nothing but the daemon's
  accounting. It is never safe on CUDA, where freed memory is gone.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import grpc

from weightcache._log import get_logger
from weightcache.core.errors import DaemonUnavailableError, LeaseLostError
from weightcache.core.forking import calling
from weightcache.core.per_process import PerProcess
from weightcache.core.protocol import lease_status_from_pb
from weightcache.core.rpc import retire, shared
from weightcache.core.stalls import StallWatch
from weightcache.v1 import weight_cache_service_pb2 as pb

log = get_logger("weightcache.lease")

Policy = Literal["raise", "exit", "ignore"]
POLICIES: tuple[Policy, ...] = ("raise", "exit", "ignore")


def default_policy(device_type: str) -> Policy:
    """The loss policy when none is given: ``"ignore"`` for shared memory (``"cpu"``),
    ``"exit"`` for device memory."""
    return "ignore" if device_type == "cpu" else "exit"


RevokePolicy = Literal["keep", "copy", "raise", "exit"]
REVOKE_POLICIES: tuple[RevokePolicy, ...] = ("keep", "copy", "raise", "exit")
#: Seconds between attempts to reach the successor of a daemon that handed over.
RECONNECT_INTERVAL = 0.1
#: Seconds a session waits at least (longer where a lease's validity left is longer),
#: after a daemon announced a hand-over, for its successor to answer, before the leases
#: are lost. Meanwhile their validity window does not run: no
#: daemon can free a handed-over arena (it waits under a hand-over name that only a
#: successor adopts, or ``weightcache gc`` after ``HANDOVER_GRACE``, 600 s), and the
#: successor gives every lease it adopts a full TTL from its adoption, then answers for
#: it (ACTIVE from its new instance: kept; NOT_FOUND: lost). A restart on a loaded host
#: (start-up 20 to 30 s has been seen) would otherwise lose every lease at the default
#: 10 s TTL (issue 39).
HANDOVER_WAIT = 60.0
#: A stall of the keepalive thread at least this long (seconds) is logged.
STALL_LOGGED = 1.0
#: Exit status under the ``exit`` policy (EX_TEMPFAIL from sysexits.h).
EXIT_LEASE_LOST = 75
Clock = Callable[[], float]
LostCallback = Callable[[LeaseLostError], None]


@dataclass
class ClientLease:
    """A lease as the client tracks it.

    Attributes:
        lease_id: the daemon's id.
        instance_id: the daemon instance that granted it.
        ttl: seconds granted.
        policy: what to do when it is lost.
        on_lost: called (on the keepalive thread) when it is lost, before the policy.
        last_ack: clock reading of the daemon's last acknowledgement (once added to a
            :class:`KeepAliveSession`, on its stall-watch clock).
        on_revoke: what to do on REVOKING.
        privatize: makes this process's mapping private (for ``on_revoke="copy"``).
        lost: the loss, once it happened.
        revoked: the lease was revoked and handled by copying (the tensors are private)
            or by keeping the unlinked mapping (``kept``).
        kept: revoked and handled by keeping the mapping: renewed until ``close()``
            releases it, never lost.
        pid: the process that acquired it, the only one that renews or releases it (a
            forked child inherits the object, not the lease).
    """

    lease_id: str
    instance_id: str
    ttl: float
    policy: Policy
    on_lost: LostCallback | None
    last_ack: float
    on_revoke: RevokePolicy = "keep"
    privatize: Callable[[], None] | None = None
    lost: LeaseLostError | None = None
    revoked: bool = False
    kept: bool = False
    pid: int = field(default_factory=os.getpid)
    _fired: threading.Event = field(default_factory=threading.Event)

    @property
    def validity(self) -> float:
        """Seconds a lease stays valid after an acknowledgement: 2/3 of its TTL."""
        return self.ttl * 2 / 3

    def check(self) -> None:
        """Raise the loss if the lease is lost under the ``raise`` policy.

        Raises:
            LeaseLostError: the lease was lost and the policy is ``"raise"``.
        """
        if self.lost is not None and self.policy == "raise":
            raise self.lost

    def wait_lost(self, timeout: float) -> bool:
        """Block until the loss was handled, up to ``timeout`` seconds; True if it was."""
        return self._fired.wait(timeout)


class KeepAliveSession:
    """The KeepAlive stream of this process to one daemon, renewing all its leases.

    The stream runs on a daemon thread for the life of the process, or until it breaks.

    Leases are timed on the clock of a :class:`StallWatch` that the renewing thread beats
    around its timed waits: time that thread was not scheduled (an overloaded host,
    SIGSTOP) stops that clock, so it is not taken for the daemon's silence. After such a
    stall the renewal goes out at once and the daemon's answer decides (ACTIVE: kept;
    NOT_FOUND: lost).

    Args:
        socket: the daemon's socket path.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, socket: str, clock: Clock = time.monotonic) -> None:
        self.socket = socket
        #: The renewing thread's stalls; its clock times acknowledgements and validity.
        self.stalls = StallWatch(clock)
        self._clock = self.stalls.now
        self._leases: dict[str, ClientLease] = {}
        self._lock = threading.Lock()
        self._wake: queue.Queue[None] = queue.Queue()
        self._closed = threading.Event()
        # The process's shared channel: its Acquires and Releases use the same connection.
        self._channel, self._stub = shared(socket)
        #: The daemon announced a hand-over (KeepAliveResponse.hand_over) on this stream.
        self._handed_over = False
        #: Clock reading until which the leases wait for a successor's first answer (after
        #: a hand-over: :data:`HANDOVER_WAIT`), their validity not running; None otherwise.
        self._successor_until: float | None = None
        self._thread = threading.Thread(target=self._run, name="weightcache-keepalive", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the stream still runs and accepts leases."""
        return not self._closed.is_set()

    def add(self, lease: ClientLease) -> None:
        """Start renewing a lease (the first renewal is sent at once); its ``last_ack``
        is reset to now on this session's clock (:attr:`stalls`), on which it is kept."""
        lease.last_ack = self._clock()
        with self._lock:
            self._leases[lease.lease_id] = lease
        self._wake.put(None)
        if not self.alive:
            self._lose(lease, f"keepalive stream to {self.socket} ended")

    def remove(self, lease_id: str) -> None:
        """Stop renewing a lease (before releasing it): it is left out of the next
        renewal, sent when due (waking the stream to send the others at once would cost
        a round trip beside the Release)."""
        with self._lock:
            self._leases.pop(lease_id, None)

    def _run(self) -> None:
        reconnect_until: float | None = None
        try:
            while True:
                try:
                    for response in self._stub.KeepAlive(self._requests()):
                        reconnect_until = None
                        self._on_response(response)
                except grpc.RpcError as exc:
                    if reconnect_until is None and not self._handed_over:
                        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
                        self._lose_all(f"keepalive stream to {self.socket} broke ({code})")
                        return
                if self._handed_over:
                    # The daemon stopped for a restart and handed its leases over: its
                    # successor on the same socket adopts them with a full TTL and answers.
                    self._handed_over = False
                    reconnect_until = self._clock() + max(HANDOVER_WAIT, self._validity_left())
                    self._successor_until = reconnect_until
                    log.info("daemon handing over: reconnecting", socket=self.socket)
                if reconnect_until is None or not self._reconnect(reconnect_until):
                    return

        finally:
            self._closed.set()
            self._lose_all(f"keepalive stream to {self.socket} ended")
            # The stream ends when the daemon goes (or breaks): the next load connects anew.
            retire(self.socket, self._channel)

    def _reconnect(self, until: float) -> bool:
        """Open a channel to the socket again, retrying until ``until`` (clock seconds)
        while no socket is there; False if none came."""
        retire(self.socket, self._channel)
        while self._clock() < until:
            time.sleep(RECONNECT_INTERVAL)
            try:
                self._channel, self._stub = shared(self.socket)
            except DaemonUnavailableError:
                continue  # the successor has not bound the socket yet
            return True
        return False

    def _validity_left(self) -> float:
        """Seconds until the last live lease's validity passes (0 without one)."""
        with self._lock:
            leases = list(self._leases.values())
        now = self._clock()
        return max((lease.last_ack + lease.validity - now for lease in leases), default=0.0)

    def _requests(self) -> Iterator[pb.KeepAliveRequest]:
        # Holds lease ids only, never a ClientLease: the generator's frame lives as long as
        # the stream, and a lease kept here would keep its arena mapped after close().
        stalled = self.stalls.stalled
        next_send = 0.0
        while True:
            ids, interval = self._live_leases()
            if not ids:
                # Idle: keep the stream (one per process) for the next lease.
                self._wait_wake(1.0)
                next_send = 0.0
                continue
            now = self._clock()
            if now >= next_send:
                next_send = now + interval
                yield pb.KeepAliveRequest(lease_ids=ids)
            if self._wait_wake(min(interval / 4, 0.25)):
                next_send = 0.0
            elif self.stalls.stalled > stalled:
                # This thread was not scheduled for a while: renew now, and let the
                # daemon's answer say whether the leases are still there.
                next_send = 0.0
            stalled = self.stalls.stalled

    def _live_leases(self) -> tuple[list[str], float]:
        """Declare lost the leases whose validity passed; the ids of the others and the
        renewal interval (a third of the shortest TTL), in seconds."""
        with self._lock:
            leases = list(self._leases.values())
        now = self._clock()
        waiting = self._successor_until
        for lease in leases:
            if waiting is not None and now > waiting:
                self._lose(lease, "no successor answered after the hand-over")
            elif waiting is None and now - lease.last_ack > lease.validity:
                self._lose(lease, f"no keepalive acknowledgement for {lease.validity:.1f} s")
        live = [lease for lease in leases if lease.lost is None]
        interval = min((lease.ttl for lease in live), default=3.0) / 3
        return [lease.lease_id for lease in live], interval

    def _wait_wake(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; True if one came. The wait is a
        beat of :attr:`stalls`: waking later than ``timeout`` is a stall of this thread."""
        self.stalls.beat(timeout)
        try:
            self._wake.get(timeout=timeout)
        except queue.Empty:
            return False
        finally:
            stall = self.stalls.beat(None)  # until the next wait, sends may block
            if stall >= STALL_LOGGED:
                log.info(
                    "keepalive thread was not scheduled: renewing at once",
                    seconds=round(stall, 3),
                    socket=self.socket,
                )
        return True

    def _on_response(self, response: pb.KeepAliveResponse) -> None:
        now = self._clock()
        self._handed_over |= response.hand_over
        for status in map(lease_status_from_pb, response.leases):
            with self._lock:
                lease = self._leases.get(status.lease_id)
            if lease is None:
                continue
            if response.instance_id != lease.instance_id and status.state == "active":
                # A successor adopted the lease (hand-over): same id, new instance.
                log.info("lease handed over", lease=lease.lease_id[:8])
                lease.instance_id = response.instance_id
                lease.last_ack = now
            elif response.instance_id != lease.instance_id:
                self._lose(lease, "the daemon restarted (new instance id)")
            elif status.state == "active":
                lease.last_ack = now
            elif lease.kept and status.state == "revoking":
                lease.last_ack = now  # still counted by the daemon as mapped
            elif status.state == "revoking":
                self._revoke(lease, keep=status.revoke_deadline is None)
            else:
                self._lose(lease, "the daemon no longer knows the lease")
        if not response.hand_over:
            # A daemon answered (after the statuses above renewed what it knows): the
            # leases' validity runs again.
            self._successor_until = None

    def _revoke(self, lease: ClientLease, *, keep: bool) -> None:
        """Handle REVOKING under the lease's ``on_revoke``; ``keep``: the daemon frees
        nothing under the mapping (no deadline), so ``"keep"`` may keep it."""
        if lease.on_revoke == "keep" and keep:
            lease.revoked = lease.kept = True
            log.warning("lease revoked: keeping the mapping, no copy", lease=lease.lease_id[:8])
            self._wake.put(None)  # renew at once: tells a draining daemon it may go
            return
        if lease.on_revoke not in ("keep", "copy") or lease.privatize is None:
            if lease.on_revoke == "exit":
                lease.policy = "exit"
            self._lose(lease, "the daemon is revoking the lease (evict or drain)")
            return
        try:
            lease.privatize()
        except (RuntimeError, OSError) as exc:
            self._lose(lease, f"revoked, and copying the weights failed: {exc}")
            return
        lease.revoked = True
        with self._lock:
            self._leases.pop(lease.lease_id, None)
        log.warning("lease revoked: weights copied to private memory", lease=lease.lease_id[:8])
        # If Release fails the daemon frees the memory at the revoke deadline anyway.
        with contextlib.suppress(grpc.RpcError, DaemonUnavailableError), calling():
            self._stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=5.0)

    def _lose_all(self, why: str) -> None:
        with self._lock:
            leases = list(self._leases.values())
        for lease in leases:
            self._lose(lease, why)

    def _lose(self, lease: ClientLease, why: str) -> None:
        with self._lock:
            if self._leases.pop(lease.lease_id, None) is None:
                return
        if lease.kept:
            # Revoked and kept: the mapping is ours whatever the daemon does; nothing lost.
            log.info("revoked lease ended", lease=lease.lease_id[:8], why=why)
            return
        lease.lost = LeaseLostError(f"lease {lease.lease_id[:8]} lost: {why}")
        # Under "ignore" (the CPU default) the mapping keeps its bytes: nothing is lost
        # that the worker reads, so it is a warning, not an error.
        emit = log.warning if lease.policy == "ignore" else log.error
        emit("lease lost", lease=lease.lease_id[:8], why=why, policy=lease.policy)
        try:
            if lease.on_lost is not None:
                lease.on_lost(lease.lost)
        finally:
            lease._fired.set()
            if lease.policy == "exit":
                os._exit(EXIT_LEASE_LOST)


#: This process's KeepAlive sessions by socket path (a thread does not survive fork).
_sessions: PerProcess[str, KeepAliveSession] = PerProcess()


def live_session(socket: str) -> KeepAliveSession | None:
    """This process's running KeepAlive session to ``socket``, if any (never starts one)."""
    with _sessions.lock:
        session = _sessions.entries().get(socket)
        return session if session is not None and session.alive else None


def session_for(socket: str, clock: Clock = time.monotonic) -> KeepAliveSession:
    """This process's live KeepAlive session to ``socket``, started if needed.

    Raises:
        DaemonUnavailableError: no socket file exists at the path.
    """
    with _sessions.lock:
        sessions = _sessions.entries()
        session = sessions.get(socket)
        if session is None or not session.alive:
            session = sessions[socket] = KeepAliveSession(socket, clock)
        return session
