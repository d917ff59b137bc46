"""Leases across real processes: a worker that dies, a daemon that dies."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

import weightcache
from tests.security_support import acquire_request
from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    get_model,
    rpc_failure,
    run_cli,
    service_stub,
    wait_until,
)
from weightcache.v1 import weight_cache_service_pb2 as pb

#: Seconds of scheduling slack allowed on top of a lease's validity window.
SLACK = 0.5
#: A TTL long enough that an expiry cannot explain a lease ending during a test.
LONG_TTL = 30.0
SHORT_TTL = 1.5
#: Issue 9 item 5 revived 15 of 20 expired leases; 20 trials make a revival all but certain.
EXPIRY_TRIALS = 20
#: Seconds after a lease's expiry at which the KeepAlive naming it is sent: well inside the
#: daemon's 0.2 s reaper interval, so the lease is usually expired but not yet reaped.
PAST_EXPIRY = 0.02


def test_killed_worker_ends_its_lease_and_evict_succeeds(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=LONG_TTL)
    assert_attached(reply)
    assert reply["lease"]["ttl"] == LONG_TTL
    assert worker.request("wait_ack", key="w", seconds=LONG_TTL / 3 + 5)["ok"]
    assert get_model(daemon.socket, "single").lease_count == 1

    # While the lease lives, Evict without force is refused, on the wire and by the CLI.
    with service_stub(daemon.socket) as stub, pytest.raises(grpc.RpcError) as raised:
        stub.Evict(pb.EvictRequest(name="single"), timeout=10)
    failure = rpc_failure(raised.value)
    assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASES_ACTIVE")
    assert (failure.domain, failure.metadata["leases"]) == ("weightcache.v1", "1")
    refused = run_cli("evict", "single", "--socket", daemon.socket)
    assert refused.returncode == 1
    assert "LEASES_ACTIVE" in refused.stderr

    assert worker.kill() == -signal.SIGKILL
    # The KeepAlive stream closed with the process: the lease ends long before its TTL.
    waited = wait_until(lambda: get_model(daemon.socket, "single").lease_count == 0, 10.0)
    assert waited < LONG_TTL / 2
    evicted = run_cli("evict", "single", "--socket", daemon.socket)
    assert (evicted.returncode, evicted.stdout) == (0, "evicted single\n")
    with service_stub(daemon.socket) as stub:
        assert list(stub.ListModels(pb.ListModelsRequest(), timeout=10).models) == []
    assert daemon.segments() == []


def test_daemon_killed_raise_policy_worker_sees_loss_within_validity(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(
        checkpoints.single,
        socket=daemon.socket,
        ttl=SHORT_TTL,
        lease_policy="raise",
        lost_callback=True,
    )
    assert_attached(reply)
    validity = reply["lease"]["validity"]
    assert validity == pytest.approx(SHORT_TTL * 2 / 3)
    assert worker.request("wait_ack", key="w", seconds=5)["ok"]
    [segment] = daemon.segments()

    killed_at = daemon.kill()

    event = worker.event("lease_lost", timeout=validity + 5)
    assert event["error"]["type"] == weightcache.LeaseLostError.__name__
    assert event["error"]["reason"] == "LEASE_LOST"
    assert 0 <= event["t"] - killed_at <= validity + SLACK
    lost = worker.request("wait_lost", key="w", seconds=5)
    assert lost["fired"] is True
    assert lost["callback_t"] == event["t"]
    assert lost["callback_t"] - lost["last_ack"] <= validity + SLACK
    error = lost["tensors_error"]
    assert error["type"] == weightcache.LeaseLostError.__name__
    assert error["reason"] == "LEASE_LOST"
    assert error["is_lease_lost"] and error["is_callback_error"]

    # The dead daemon's socket file is still there, but nobody answers on it.
    again = worker.load(checkpoints.single, key="again", socket=daemon.socket)
    assert again["source"] == "disk"
    assert again["fallback_reason"]["code"] == "DAEMON_UNAVAILABLE"

    # Its segment outlived it; the next daemon on the socket removes it.
    assert daemon.segments() == [segment]
    assert daemons.clean_after_crash(daemon.socket) == [segment]


def test_daemon_killed_exit_policy_worker_exits_75(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.sharded])
    worker = workers.start()
    reply = worker.load(
        checkpoints.sharded,
        socket=daemon.socket,
        ttl=SHORT_TTL,
        lease_policy="exit",
        lost_callback=True,
    )
    assert_attached(reply)
    validity = reply["lease"]["validity"]
    assert worker.request("wait_ack", key="w", seconds=5)["ok"]
    segments = daemon.segments()
    assert len(segments) == 1

    killed_at = daemon.kill()

    event = worker.event("lease_lost", timeout=validity + 5)
    assert 0 <= event["t"] - killed_at <= validity + SLACK
    assert worker.proc.wait(timeout=validity + 5) == weightcache.EXIT_LEASE_LOST == 75
    assert time.monotonic() - killed_at <= validity + 5
    assert daemons.clean_after_crash(daemon.socket) == segments


def test_keepalive_after_expiry_is_not_found_and_ends_the_unlinked_arena(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    ttl = 3.0
    with service_stub(daemon.socket) as stub:
        # Staggered, so each lease expires on its own and is one trial.
        leases = []
        for _ in range(EXPIRY_TRIALS):
            leases.append(stub.Acquire(acquire_request(checkpoints.single, ttl=ttl), timeout=10))
            time.sleep(0.05)
        assert [reply.lease.ttl.ToNanoseconds() for reply in leases] == [3_000_000_000] * 20
        # On shared memory a forced evict drops the model at once; its arena is listed as
        # unlinked while these leases last, and the last one to end takes it off the list.
        evicted = stub.Evict(pb.EvictRequest(name="single", force=True), timeout=10)
        assert evicted.model.lease_count == EXPIRY_TRIALS
        listed = stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert list(listed.models) == []
        assert [(u.model, u.lease_count) for u in listed.unlinked] == [("single", EXPIRY_TRIALS)]
        assert daemon.segments() == []

        requests: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()

        def sent() -> Iterator[pb.KeepAliveRequest]:
            while (request := requests.get()) is not None:
                yield request

        stream = stub.KeepAlive(sent(), timeout=60)
        states = []
        for reply in leases:
            expiry = reply.lease.expire_time.ToNanoseconds() / 1e9
            time.sleep(max(0.0, expiry + PAST_EXPIRY - time.time()))
            requests.put(pb.KeepAliveRequest(lease_ids=[reply.lease.lease_id]))
            [status] = next(stream).leases
            assert status.lease_id == reply.lease.lease_id
            states.append(pb.LeaseState.Name(status.state))
        left = stub.ListModels(pb.ListModelsRequest(), timeout=10).unlinked
        requests.put(None)
        stream.cancel()

    assert states == ["LEASE_STATE_NOT_FOUND"] * EXPIRY_TRIALS
    assert list(left) == []


def test_release_and_retried_acquire_do_not_revive_an_expired_lease(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    with service_stub(daemon.socket) as stub:
        request = acquire_request(checkpoints.single, ttl=1.0, request_id="retry-1")
        first = stub.Acquire(request, timeout=10)
        expiry = first.lease.expire_time.ToNanoseconds() / 1e9
        time.sleep(max(0.0, expiry + PAST_EXPIRY - time.time()))

        # The retry with the same request_id gets a fresh lease, not the expired one.
        retried = stub.Acquire(request, timeout=10)
        assert retried.lease.lease_id != first.lease.lease_id
        assert retried.lease.expire_time.ToNanoseconds() / 1e9 > expiry
        stub.Release(pb.ReleaseRequest(lease_id=first.lease.lease_id), timeout=10)
        assert get_model(daemon.socket, "single").lease_count == 1
        stub.Release(pb.ReleaseRequest(lease_id=retried.lease.lease_id), timeout=10)
        assert get_model(daemon.socket, "single").lease_count == 0


def test_a_worker_that_asks_no_ttl_gets_the_daemons_default(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    """The default TTL has one home, the daemon's: the SDK sends none unless asked, and its
    lease keeps the TTL granted."""
    from weightcache_service.leases import DEFAULT_TTL

    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket)

    assert_attached(reply)
    assert reply["lease"]["ttl"] == DEFAULT_TTL == 10.0
    assert reply["lease"]["validity"] == pytest.approx(DEFAULT_TTL * 2 / 3)
