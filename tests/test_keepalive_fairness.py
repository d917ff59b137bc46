"""A KeepAlive flood from one peer does not starve the daemon's other clients (issue 37,
item 12), on a real daemon with flooding peers in processes of their own.

The daemon renews and answers one KeepAlive message at a time daemon-wide, in batches of
``fair_queue.BATCH_IDS`` ids with the event loop serving other RPCs between two, the
stream that renewed the fewest ids lately first, and gives KeepAlive work at most
``fair_queue.SHARE`` of its loop (``weightcache_service/fair_queue.py``). Latency is
measured by ``bench/keepalive_flood.py``; here the other client's calls must complete,
with the right answers, within a generous deadline while the flood goes on: a liveness
check, not a latency one, that does not tell the change apart (the deterministic check
below does).
The order the queue serves streams in is checked apart, on the daemon's own
``FairQueue`` in an event loop of the test's: that check is deterministic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import subprocess
import sys

from tests.fault_support import acquire_request
from tests.support import Checkpoints, DaemonPool, service_stub
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.fair_queue import FairQueue

#: Flooding processes, the KeepAlive streams each holds, and the lease ids per message:
#: the most one message may name.
FLOODERS, STREAMS, IDS = 2, 32, 4096
#: Seconds within which another client's call must complete: a liveness check, generous
#: so that a CI machine busy with the flood itself never fails it by timing (after the
#: fair queue, bench/keepalive_flood.py's worst GetServerInfo was 0.55 s on a loaded 2-CPU
#: machine; before it, up to 5.5 s).
DEADLINE = 20.0
#: Calls of each kind the other client makes during the flood.
CALLS = 3


def test_another_client_is_served_while_a_peer_floods_keepalive(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    reader = concurrent.futures.ThreadPoolExecutor(1)  # a renewal's answer, with a deadline
    with reader, service_stub(daemon.socket) as other:
        instance = other.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).instance_id
        lease = other.Acquire(acquire_request(checkpoints.single), timeout=10).lease
        # The other client's own KeepAlive stream, open before the flood.
        asks: queue.SimpleQueue[pb.KeepAliveRequest | None] = queue.SimpleQueue()
        renewals = other.KeepAlive(iter(asks.get, None), timeout=60)
        asks.put(pb.KeepAliveRequest(lease_ids=[lease.lease_id]))
        first = next(renewals)
        flooders = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.keepalive_flooder",
                    daemon.socket,
                    str(STREAMS),
                    str(IDS),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(FLOODERS)
        ]
        try:
            for flooder in flooders:
                assert flooder.stdout is not None
                assert flooder.stdout.readline() == b"flooding\n"
            expiries = [first.leases[0].expire_time.ToNanoseconds()]
            for _ in range(CALLS):
                info = other.GetServerInfo(pb.GetServerInfoRequest(), timeout=DEADLINE)
                assert info.instance_id == instance
                asks.put(pb.KeepAliveRequest(lease_ids=[lease.lease_id]))
                reply = reader.submit(next, renewals).result(timeout=DEADLINE)
                assert reply.instance_id == instance
                assert [(s.lease_id, s.state) for s in reply.leases] == [
                    (lease.lease_id, pb.LEASE_STATE_ACTIVE)
                ]
                expiries.append(reply.leases[0].expire_time.ToNanoseconds())
            assert expiries == sorted(expiries)  # each renewal extended the lease
            for flooder in flooders:
                assert flooder.poll() is None  # still flooding: the calls above were under it
        finally:
            for flooder in flooders:
                flooder.kill()
                flooder.wait(30)
                for pipe in (flooder.stdin, flooder.stdout):
                    assert pipe is not None
                    pipe.close()
            asks.put(None)
            renewals.cancel()


#: A message queued (its stream, its ids, a name for it), or the clock set to (seconds).
Step = tuple[str, int, str] | float


def _served(before: list[Step], holder: tuple[str, int, str], queued: list[Step]) -> list[str]:
    """The order in which a ``FairQueue`` on a clock of the test's (0 until a step sets it)
    serves messages: ``before`` one after another, then ``holder``, which holds its turn
    while ``queued`` are queued in order, then lets it go."""

    async def run() -> list[str]:
        now = [0.0]
        fair = FairQueue(clock=lambda: now[0])
        order: list[str] = []
        holding, release = asyncio.Event(), asyncio.Event()

        async def work(flow: str, cost: int, name: str, hold: bool = False) -> None:
            async with fair.turn(flow, cost):
                order.append(name)
                if hold:
                    holding.set()
                    await release.wait()

        async def step(item: Step) -> asyncio.Task[None] | None:
            if isinstance(item, float):
                now[0] = item
                return None
            task = asyncio.create_task(work(*item))
            await asyncio.sleep(0)  # queued before the next step
            return task

        for item in before:
            if (task := await step(item)) is not None:
                await task
        first = asyncio.create_task(work(*holder, hold=True))
        await holding.wait()  # in progress; whatever comes now waits
        tasks = [task for item in queued if (task := await step(item)) is not None]
        release.set()
        await asyncio.gather(first, *tasks)
        return order

    return asyncio.run(run())


def test_a_stream_naming_few_ids_is_served_before_waiting_floods() -> None:
    # The worker's one id first (queued last), then the answer to the message renewed
    # (an answer before a message of the same usage), then the other flooding streams'
    # messages in the order they came.
    assert _served(
        [("flood-0", IDS, "flood-0 earlier")],  # a stream that has been flooding
        ("flood-0", IDS, "flood-0 renew"),
        [
            ("flood-1", IDS, "flood-1 renew"),
            ("flood-2", IDS, "flood-2 renew"),
            ("flood-0", 0, "flood-0 answer"),
            ("worker", 1, "worker renew"),
        ],
    ) == [
        "flood-0 earlier",
        "flood-0 renew",
        "worker renew",
        "flood-0 answer",
        "flood-1 renew",
        "flood-2 renew",
    ]


def test_a_stream_naming_many_ids_is_not_starved_by_lighter_floods() -> None:
    # Issue 37 review: a message's place was fixed when it was queued, so streams that
    # keep sending messages of a few hundred ids were always ahead of one that names more
    # (its leases would expire). Its usage now decays while it waits (`_priority`): 3
    # half-lives later its 600 ids count as 75.
    assert _served(
        [],
        ("light-0", 256, "light-0 renew"),
        [
            ("heavy", 600, "heavy renew"),
            3.0,
            ("light-1", 256, "light-1 renew"),
            ("light-2", 256, "light-2 renew"),
        ],
    ) == ["light-0 renew", "heavy renew", "light-1 renew", "light-2 renew"]
