"""A ``load()`` that would send the very Acquire an open load of the same process sent
shares that load's lease (``weightcache._sharing``): no Acquire, one lease at the daemon,
and a private mapping of its own, so that a write through one load is not seen through
the other."""

from __future__ import annotations

import gc
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

import weightcache
from tests.fault_support import Children, evict, list_models, refused
from tests.fault_worker import segment_maps
from tests.support import Checkpoints, DaemonPool, get_model, rpc_failure, wait_until
from weightcache import _handles, _loader
from weightcache.testing.checkpoints import assert_bitwise_equal
from weightcache.testing.protocol import tensor_digest

REVOKE_TIMEOUT = 30.0


def _leases(socket: str, model: str) -> int:
    return get_model(socket, model).lease_count


def test_a_second_load_shares_the_lease_and_maps_its_own_copy(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    first = weightcache.load(checkpoints.single, socket=daemon.socket, fallback=False)
    second = weightcache.load(checkpoints.single, socket=daemon.socket, fallback=False)

    assert (first.source, second.source) == ("cache", "cache")
    assert first.lease is not None and second.lease is first.lease
    lease_id = first.lease.lease_id
    assert (second.model, second.fingerprint) == (first.model, first.fingerprint)
    assert _leases(daemon.socket, "single") == 1
    assert_bitwise_equal(second.tensors, checkpoints.tensors)
    # Each load has its own copy-on-write mapping: writing one changes only that one.
    name = next(n for n, t in checkpoints.tensors.items() if t.numel() and t.is_floating_point())
    second.tensors[name].fill_(7)
    assert_bitwise_equal(first.tensors, checkpoints.tensors)
    assert second.tensors[name].eq(7).all()

    first.close()
    assert _leases(daemon.socket, "single") == 1  # the second load still uses it
    assert second.lease is not None and second.lease.lost is None
    second.close()
    assert _leases(daemon.socket, "single") == 0
    third = weightcache.load(checkpoints.single, socket=daemon.socket, fallback=False)
    assert third.lease is not None and third.lease.lease_id != lease_id
    assert _leases(daemon.socket, "single") == 1
    third.close()


def test_loads_with_other_lease_options_or_another_mode_hold_leases_of_their_own(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    socket = daemon.socket
    held = weightcache.load(checkpoints.single, socket=socket, ttl=30.0)
    other_ttl = weightcache.load(checkpoints.single, socket=socket, ttl=20.0)
    other_policy = weightcache.load(checkpoints.single, socket=socket, ttl=30.0, on_revoke="raise")
    copied = weightcache.load(checkpoints.single, socket=socket, ttl=30.0, mode="copy")

    leases = [w.lease for w in (held, other_ttl, other_policy)]
    assert all(lease is not None for lease in leases)
    assert len({id(lease) for lease in leases}) == 3
    assert copied.lease is None
    assert _leases(socket, "single") == 3
    for weights in (held, other_ttl, other_policy, copied):
        assert weights.source == "cache"
        assert_bitwise_equal(weights.tensors, checkpoints.tensors)
        weights.close()
    assert _leases(socket, "single") == 0


def test_changed_files_are_asked_for_again(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """New file identities make another request: the daemon is asked, by fingerprint."""
    folder = tmp_path / "single"
    shutil.copytree(checkpoints.single, folder)
    daemon = daemons.start([folder])
    first = weightcache.load(folder, socket=daemon.socket, fallback=False)
    shard = folder / "model.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))

    second = weightcache.load(folder, socket=daemon.socket, fallback=False)

    assert (first.source, second.source) == ("cache", "cache")
    assert first.lease is not None and second.lease is not None
    assert second.lease is not first.lease
    assert _leases(daemon.socket, "single") == 2
    assert_bitwise_equal(second.tensors, checkpoints.tensors)
    first.close()
    second.close()


def test_a_lost_lease_is_not_shared(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    socket = daemons.socket("lost")
    daemon = daemons.start([checkpoints.single], socket=socket)
    first = weightcache.load(checkpoints.single, socket=socket, fallback=False)
    assert first.lease is not None
    lease = first.lease
    daemon.kill()
    assert lease.wait_lost(REVOKE_TIMEOUT)
    again = daemons.start([checkpoints.single], socket=socket)

    second = weightcache.load(checkpoints.single, socket=socket, fallback=False)

    assert second.source == "cache"
    assert second.lease is not None and second.lease is not lease
    assert second.lease.instance_id != lease.instance_id
    assert _leases(again.socket, "single") == 1
    assert_bitwise_equal(second.tensors, checkpoints.tensors)
    second.close()
    first.close()


def test_a_revoke_makes_every_sharing_load_private(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    """A forced evict revokes the one lease two loads of a worker share: with
    ``on_revoke="copy"`` both mappings become private copies, bytes unchanged."""
    daemon = daemons.start([checkpoints.single], args=["--drain-timeout", "60"])
    expected = tensor_digest(checkpoints.tensors)
    [kid] = children.start(1)
    options: dict[str, Any] = {"socket": daemon.socket, "ttl": 60.0, "on_revoke": "copy"}
    replies = [kid.load(checkpoints.single, key=key, **options) for key in ("a", "b")]
    assert [r["source"] for r in replies] == ["cache", "cache"], replies
    assert replies[0]["lease"]["id"] == replies[1]["lease"]["id"]
    assert [r["digest"] for r in replies] == [expected, expected]
    assert _leases(daemon.socket, "single") == 1
    [segment] = daemon.segments()

    evict(daemon.socket, "single", force=True)
    wait_until(lambda: kid.request("lease", key="a")["revoked"], REVOKE_TIMEOUT)
    wait_until(lambda: "single" not in list_models(daemon.socket), REVOKE_TIMEOUT)

    assert kid.request("lease", key="b")["revoked"] is True
    for key in ("a", "b"):
        now = kid.request("digest", key=key)
        assert (now["digest"], now["tensors_error"]) == (expected, None)
    mappings = kid.request("maps")["maps"]
    assert [(m["path"], m["deleted"]) for m in mappings] == [(segment, True)] * 2
    for mapping in mappings:
        # Anonymous: copied into this process (the segment's own pages count as dirty too).
        assert mapping["Anonymous"] == mapping["Rss"] == mapping["Size"] > 0, mapping


def test_weights_dropped_without_close_are_still_copied_on_a_revoke(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--drain-timeout", "60"])
    weights = weightcache.load(checkpoints.single, socket=daemon.socket, on_revoke="copy")
    tensors, lease = weights.tensors, weights.lease
    assert lease is not None
    [segment] = daemon.segments()
    del weights
    gc.collect()

    evict(daemon.socket, "single", force=True)
    wait_until(lambda: lease.revoked, REVOKE_TIMEOUT)

    [mapping] = [m for m in segment_maps() if m["path"] == segment]
    assert mapping["Anonymous"] == mapping["Rss"] == mapping["Size"] > 0, mapping
    assert_bitwise_equal(tensors, checkpoints.tensors)


def test_a_load_that_joins_while_the_lease_is_revoked_copies_its_own_mapping(
    daemons: DaemonPool, checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second load has taken its share and is mapping the segment when the revoke
    starts copying the first load's mapping: it copies its own as it joins."""
    daemon = daemons.start([checkpoints.single], args=["--drain-timeout", "60"])
    first = weightcache.load(checkpoints.single, socket=daemon.socket, on_revoke="copy")
    lease = first.lease
    assert lease is not None
    [segment] = daemon.segments()
    revoking = threading.Event()
    privatize = _handles.MappedArena.privatize
    open_shared_memory = _handles.open_shared_memory

    def privatize_seen(arena: _handles.MappedArena) -> None:
        revoking.set()
        privatize(arena)

    def open_then_revoke(*args: Any, **kwargs: Any) -> _handles.MappedArena:
        arena = open_shared_memory(*args, **kwargs)
        evict(daemon.socket, "single", force=True)
        assert revoking.wait(REVOKE_TIMEOUT)  # the keepalive thread is copying now
        return arena

    monkeypatch.setattr(_handles.MappedArena, "privatize", privatize_seen)
    monkeypatch.setattr(_loader, "open_shared_memory", open_then_revoke)
    second = weightcache.load(checkpoints.single, socket=daemon.socket, on_revoke="copy")
    monkeypatch.undo()
    wait_until(lambda: lease.revoked, REVOKE_TIMEOUT)

    assert second.lease is lease
    mappings = [m for m in segment_maps() if m["path"] == segment]
    assert len(mappings) == 2
    for mapping in mappings:
        assert mapping["Anonymous"] == mapping["Rss"] == mapping["Size"] > 0, mapping
    assert_bitwise_equal(second.tensors, checkpoints.tensors)
    assert_bitwise_equal(first.tensors, checkpoints.tensors)


class _Callback:
    """A lease-loss callback that compares equal to any other and cannot be hashed."""

    def __init__(self) -> None:
        self.calls = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Callback)

    __hash__ = None  # type: ignore[assignment]

    def __call__(self, error: weightcache.LeaseLostError) -> None:
        self.calls += 1


def test_each_loss_callback_object_holds_its_own_lease(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    """By identity: an unhashable callback is fine, and two equal callbacks are two."""
    daemon = daemons.start([checkpoints.single])
    callbacks = [_Callback(), _Callback()]
    loads = [
        weightcache.load(checkpoints.single, socket=daemon.socket, on_lease_lost=callback)
        for callback in (*callbacks, callbacks[0])
    ]

    assert [w.source for w in loads] == ["cache"] * 3
    assert loads[0].lease is loads[2].lease
    assert loads[1].lease is not loads[0].lease
    assert _leases(daemon.socket, "single") == 2
    for weights in loads:
        weights.close()
    assert _leases(daemon.socket, "single") == 0


def test_a_forked_child_closing_inherited_weights_leaves_the_parent_s_lease(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    """The lease is the parent's: a child leaving the parent's ``with`` blocks must not
    release it, or the parent's next load would join a lease the daemon has ended (and a
    plain evict would free the model under the parent's three loads)."""
    daemon = daemons.start([checkpoints.single])
    options: dict[str, Any] = {"socket": daemon.socket, "fallback": False}
    first = weightcache.load(checkpoints.single, **options)
    second = weightcache.load(checkpoints.single, **options)

    pid = os.fork()
    if pid == 0:  # the child: no gRPC here, only close()
        status = 1
        try:
            first.close()
            second.close()
            status = 0 if first.lease is second.lease is None else 2
        finally:
            os._exit(status)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    assert _leases(daemon.socket, "single") == 1
    third = weightcache.load(checkpoints.single, **options)
    assert third.lease is not None and third.lease is first.lease
    failure = rpc_failure(refused(lambda: evict(daemon.socket, "single")))
    assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASES_ACTIVE")
    assert_bitwise_equal(third.tensors, checkpoints.tensors)
    for weights in (first, second, third):
        weights.close()
    assert _leases(daemon.socket, "single") == 0
