"""The daemon's lease table, driven by an injected clock: no sleeping."""

from __future__ import annotations

import pytest

from weightcache_service.leases import DEFAULT_TTL, MAX_TTL, MIN_TTL, LeaseTable


class FakeClock:
    """Monotonic seconds that move only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock=clock)


@pytest.mark.parametrize(
    ("requested", "granted"),
    [
        (None, DEFAULT_TTL),
        (0.0, DEFAULT_TTL),
        (-5.0, DEFAULT_TTL),
        (0.1, MIN_TTL),
        (1.5, 1.5),
        (1e6, MAX_TTL),
    ],
)
def test_grant_clamps_ttl(
    table: LeaseTable, clock: FakeClock, requested: float | None, granted: float
) -> None:
    lease = table.grant("m", requested, "r", pid=7)

    assert (lease.ttl, lease.expire_at) == (granted, clock.now + granted)
    assert (lease.model, lease.pid, lease.session, lease.revoke_deadline) == ("m", 7, None, None)
    assert table.get(lease.lease_id) is lease
    assert len(table) == 1


def test_lease_ids_are_unique_and_opaque(table: LeaseTable) -> None:
    ids = {table.grant("m", 2.0, f"r{i}", pid=1).lease_id for i in range(50)}

    assert len(ids) == 50
    assert all(len(i) >= 32 for i in ids)


def test_unrenewed_lease_expires_at_its_ttl(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("m", 2.0, "r", pid=1)

    clock.advance(1.999)
    assert table.reap() == []
    clock.advance(0.001)
    assert table.reap() == [lease]
    assert table.get(lease.lease_id) is None
    assert len(table) == 0
    assert table.reap() == []


def test_renew_extends_from_now_and_binds_the_session(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("m", 2.0, "r", pid=1)
    session = table.open_session()

    clock.advance(1.5)
    assert table.renew(lease.lease_id, session) is lease
    assert (lease.expire_at, lease.session) == (clock.now + 2.0, session)
    clock.advance(1.9)
    assert table.reap() == []
    clock.advance(0.1)
    assert table.reap() == [lease]


def test_renew_unknown_lease_is_none(table: LeaseTable) -> None:
    assert table.renew("no-such-lease", table.open_session()) is None


def test_sessions_have_distinct_ids(table: LeaseTable) -> None:
    first, second = table.open_session(), table.open_session()

    assert first != second


def test_end_session_ends_exactly_its_leases(table: LeaseTable) -> None:
    one, two = table.open_session(), table.open_session()
    a = table.grant("m", 5.0, "a", pid=1)
    b = table.grant("m", 5.0, "b", pid=1)
    c = table.grant("m", 5.0, "c", pid=2)
    unbound = table.grant("m", 5.0, "d", pid=3)
    table.renew(a.lease_id, one)
    table.renew(b.lease_id, one)
    table.renew(c.lease_id, two)

    ended = table.end_session(one)

    assert sorted(lease.lease_id for lease in ended) == sorted([a.lease_id, b.lease_id])
    assert table.for_model("m") == [c, unbound]
    assert table.end_session(one) == []


def test_grant_is_idempotent_by_request_id(table: LeaseTable, clock: FakeClock) -> None:
    first = table.grant("m", 2.0, "req-1", pid=1)
    clock.advance(0.5)

    again = table.grant("m", 9.0, "req-1", pid=1)

    assert again is first
    assert (again.ttl, again.expire_at) == (2.0, 1002.0)
    assert len(table) == 1


def test_request_id_grants_anew_once_its_lease_ended(table: LeaseTable) -> None:
    first = table.grant("m", 2.0, "req-1", pid=1)
    table.release(first.lease_id)

    second = table.grant("m", 2.0, "req-1", pid=1)

    assert second.lease_id != first.lease_id
    assert table.get(second.lease_id) is second


def test_empty_request_id_is_never_deduplicated(table: LeaseTable) -> None:
    first = table.grant("m", 2.0, "", pid=1)
    second = table.grant("m", 2.0, "", pid=1)

    assert first.lease_id != second.lease_id
    assert len(table) == 2


def test_release_is_idempotent(table: LeaseTable) -> None:
    lease = table.grant("m", 2.0, "r", pid=1)

    assert table.release(lease.lease_id) is lease
    assert table.release(lease.lease_id) is None
    assert table.release("never-granted") is None
    assert len(table) == 0


def test_revoked_lease_ends_at_its_deadline_even_when_renewed(
    table: LeaseTable, clock: FakeClock
) -> None:
    held = table.grant("m", 10.0, "a", pid=1)
    other = table.grant("n", 10.0, "b", pid=1)
    session = table.open_session()

    assert table.revoke("m", clock.now + 3.0) == [held]
    assert (held.revoke_deadline, other.revoke_deadline) == (clock.now + 3.0, None)
    clock.advance(2.0)
    table.renew(held.lease_id, session)
    assert table.reap() == []
    clock.advance(1.0)
    assert table.reap() == [held]
    assert table.for_model("n") == [other]


def test_expired_lease_is_gone_before_it_is_reaped(table: LeaseTable, clock: FakeClock) -> None:
    # Issue 9 item 5: as in etcd, a lease past its TTL is gone; a KeepAlive naming it before
    # the reaper runs must not revive it.
    lease = table.grant("m", 2.0, "req-1", pid=1)
    session = table.open_session()
    clock.advance(2.0)

    assert table.renew(lease.lease_id, session) is None
    assert (lease.expire_at, lease.session) == (1002.0, None)
    assert table.get(lease.lease_id) is None
    assert table.for_model("m") == []
    again = table.grant("m", 2.0, "req-1", pid=1)
    assert again.lease_id != lease.lease_id
    assert table.reap() == [lease]
    assert table.reap() == []
    assert table.for_model("m") == [again]


def test_end_if_expired_ends_only_an_expired_lease(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("m", 2.0, "r", pid=1)

    assert table.end_if_expired(lease.lease_id) is None
    assert table.get(lease.lease_id) is lease
    clock.advance(2.0)
    assert table.end_if_expired(lease.lease_id) is lease
    assert table.end_if_expired(lease.lease_id) is None
    assert table.end_if_expired("never-granted") is None
    assert (len(table), table.reap()) == (0, [])


def test_release_of_an_expired_lease_removes_it_and_returns_none(
    table: LeaseTable, clock: FakeClock
) -> None:
    lease = table.grant("m", 2.0, "req-1", pid=1)
    clock.advance(2.5)

    assert table.release(lease.lease_id) is None
    assert len(table) == 0
    assert table.reap() == []


def test_revoked_lease_past_its_deadline_is_not_renewed(
    table: LeaseTable, clock: FakeClock
) -> None:
    lease = table.grant("m", 10.0, "a", pid=1)
    table.revoke("m", clock.now + 3.0)
    clock.advance(3.0)

    assert table.renew(lease.lease_id, table.open_session()) is None
    assert table.for_model("m") == []
    assert table.reap() == [lease]
