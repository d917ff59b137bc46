"""Faults across real processes: daemons and workers SIGKILLed, restarted, raced, stressed.

Workers are forked from one zygote per module (see ``tests/fault_worker.py``): real,
separate processes, each with its own KeepAlive stream and mappings, that start in
milliseconds instead of importing torch each.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.fault_support import (
    Child,
    Children,
    disk_digest,
    evict,
    keepalive_once,
    list_models,
    refused,
    server_info,
    start_ready,
)
from tests.support import (
    REMOVED_SEGMENT,
    Checkpoints,
    Daemon,
    DaemonPool,
    get_model,
    health,
    rpc_failure,
    service_stub,
    shm_segments,
    wait_until,
)
from weightcache.testing import READY_TIMEOUT
from weightcache.testing.protocol import tensor_digest
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(300)

READY = READY_TIMEOUT  # the harness's one ready timeout
#: Seconds of scheduling slack allowed on top of a lease's validity window.
SLACK = 1.0
#: Short TTL for loss detection: validity 2 s.
SHORT_TTL = 3.0
#: A TTL long enough that an expiry cannot explain a lease ending during a test.
LONG_TTL = 60.0
#: Worker processes in the stress test (the 2-core test machine; see test docstring).
STRESS_WORKERS = 32
STRESS_SECONDS = 20.0


def attach_all(
    kids: list[Child], path: Path, expected: str, **options: Any
) -> list[dict[str, Any]]:
    """Load ``path`` in every worker at once; each must attach with bitwise the expected
    tensors and have its lease acknowledged (bound to its KeepAlive stream)."""
    for kid in kids:
        kid.send_load(path, **options)
    replies = [kid.reply("load") for kid in kids]
    for reply in replies:
        assert reply["ok"], reply
        assert (reply["source"], reply["fallback_reason"]) == ("cache", None)
        assert reply["digest"] == expected
    for kid in kids:
        kid.send("wait_ack", key="w", seconds=LONG_TTL / 3 + 10)
    assert [kid.reply("wait_ack")["ok"] for kid in kids] == [True] * len(kids)
    return replies


def test_daemon_sigkill_four_holders_see_the_loss_within_validity(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    daemon = start_ready(daemons, [checkpoints.sharded])
    expected = tensor_digest(checkpoints.tensors)
    kids = children.start(4)
    replies = attach_all(
        kids,
        checkpoints.sharded,
        expected,
        socket=daemon.socket,
        ttl=SHORT_TTL,
        lease_policy="raise",
        lost_callback=True,
    )
    validity = SHORT_TTL * 2 / 3
    assert {(r["lease"]["ttl"], r["lease"]["validity"]) for r in replies} == {(SHORT_TTL, validity)}
    assert get_model(daemon.socket, "sharded").lease_count == 4
    [segment] = daemon.segments()

    killed_at = daemon.kill()

    delays = []
    for kid in kids:
        event = kid.event("lease_lost", timeout=validity + 30)
        error = event["error"]
        assert (error["type"], error["reason"]) == ("LeaseLostError", "LEASE_LOST")
        delays.append(event["t"] - killed_at)
        assert 0 <= delays[-1] <= validity + SLACK, event
    print(f"loss seen {min(delays):.3f}-{max(delays):.3f} s after the kill (validity {validity} s)")
    # What a disk load gives after the kill is what every worker still reads.
    assert disk_digest(checkpoints.sharded) == expected
    for kid in kids:
        lost = kid.request("wait_lost", key="w", seconds=5)
        assert lost["fired"] is True
        assert lost["lost"]["reason"] == "LEASE_LOST"
        now = kid.request("digest", key="w")
        assert now["digest"] == expected
        assert now["tensors_error"]["type"] == "LeaseLostError"
        again = kid.load(checkpoints.sharded, key="disk", socket=daemon.socket)
        assert (again["source"], again["fallback_reason"]["code"]) == ("disk", "DAEMON_UNAVAILABLE")
        assert again["digest"] == expected
    # The dead daemon's segment is still there; the pool's clean-up daemon removes it.
    assert daemon.segments() == [segment]


def test_sigkill_half_of_sixteen_holders_ends_exactly_their_leases(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    daemon = start_ready(daemons, [checkpoints.single])
    expected = tensor_digest(checkpoints.tensors)
    kids = children.start(16)
    attach_all(kids, checkpoints.single, expected, socket=daemon.socket, ttl=LONG_TTL)
    assert get_model(daemon.socket, "single").lease_count == 16
    victims, survivors = kids[:8], kids[8:]

    for kid in victims:
        kid.signal(signal.SIGKILL)
    assert [kid.kill() for kid in victims] == [-signal.SIGKILL] * 8

    # Their KeepAlive streams closed with them: their leases end long before the TTL.
    waited = wait_until(lambda: get_model(daemon.socket, "single").lease_count == 8, 30.0)
    assert waited < LONG_TTL / 2
    assert list_models(daemon.socket)["single"].lease_count == 8
    with service_stub(daemon.socket) as stub:
        error = refused(lambda: stub.Evict(pb.EvictRequest(name="single"), timeout=10))
    failure = rpc_failure(error)
    assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASES_ACTIVE")
    assert failure.metadata == {"model": "single", "leases": "8"}
    for kid in survivors:
        assert kid.request("digest", key="w") == {
            "reply": "digest",
            "ok": True,
            "digest": expected,
            "tensors_error": None,
        }
        assert kid.request("close", key="w")["ok"]

    assert list_models(daemon.socket)["single"].lease_count == 0
    assert evict(daemon.socket, "single").model.name == "single"
    assert list_models(daemon.socket) == {}
    assert daemon.segments() == []
    assert daemon.stop() == 0
    assert not os.path.lexists(daemon.socket)
    assert shm_segments(daemon.tag) == []


def test_leases_do_not_survive_a_daemon_restart(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    old = start_ready(daemons, [checkpoints.single])
    expected = tensor_digest(checkpoints.tensors)
    kid = children.one()
    [reply] = attach_all(
        [kid],
        checkpoints.single,
        expected,
        socket=old.socket,
        ttl=SHORT_TTL,
        lease_policy="raise",
        lost_callback=True,
    )
    lease_id, old_instance = reply["lease"]["id"], reply["lease"]["instance_id"]
    assert server_info(old.socket).instance_id == old_instance
    [old_segment] = old.segments()

    killed_at = old.kill()
    new = start_ready(daemons, [checkpoints.single], socket=old.socket)

    event = kid.event("lease_lost", timeout=30)
    assert event["error"]["reason"] == "LEASE_LOST"
    assert "keepalive stream" in event["error"]["detail"]
    assert 0 <= event["t"] - killed_at <= SHORT_TTL * 2 / 3 + SLACK
    new_instance = server_info(new.socket).instance_id
    assert new_instance != old_instance
    # The new daemon removed the dead one's segment and holds its own.
    assert any(REMOVED_SEGMENT in line and old_segment in line for line in new.log().splitlines())
    assert old_segment not in new.segments()
    assert len(new.segments()) == 1

    # The old lease is unknown to the new daemon: Release is idempotent, KeepAlive says so.
    with service_stub(new.socket) as stub:
        for _ in range(2):
            assert stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=10) == (
                pb.ReleaseResponse()
            )
    answer = keepalive_once(new.socket, [lease_id])
    assert answer.instance_id == new_instance
    assert [(s.lease_id, s.state) for s in answer.leases] == [(lease_id, pb.LEASE_STATE_NOT_FOUND)]
    assert get_model(new.socket, "single").lease_count == 0

    # The worker keeps its bytes, refuses the lost lease's tensors, and attaches anew.
    now = kid.request("digest", key="w")
    assert (now["digest"], now["tensors_error"]["reason"]) == (expected, "LEASE_LOST")
    again = kid.load(checkpoints.single, key="again", socket=new.socket, ttl=SHORT_TTL)
    assert (again["source"], again["digest"]) == ("cache", expected)
    assert again["lease"]["instance_id"] == new_instance
    assert again["lease"]["id"] != lease_id


def test_two_daemons_on_one_socket_exactly_one_serves(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    socket = daemons.socket("race")
    # Both are started at once; the pool stops whichever still runs at teardown.
    racers = [
        Daemon(socket, [str(checkpoints.single)], daemons.log_dir / f"racer-{i}.log")
        for i in range(2)
    ]
    daemons.daemons.extend(racers)

    wait_until(lambda: any(d.proc.poll() is not None for d in racers), READY)
    [loser] = [d for d in racers if d.proc.poll() is not None]
    [winner] = [d for d in racers if d is not loser]
    daemons.daemons.remove(loser)

    assert loser.proc.returncode == 1, loser.log()
    assert (
        f"weightcache preload: socket {socket} is served by another daemon (pid {winner.pid})"
        in loser.log()
    )
    winner.wait_ready(READY)
    assert health(socket) == "SERVING"
    assert winner.proc.poll() is None
    # The loser removed nothing of the winner's: lock file, socket and segment remain.
    with open(socket + ".lock") as lock:
        assert lock.read() == f"{winner.pid}\n"
    assert len(winner.segments()) == 1
    kid = children.one()
    reply = kid.load(checkpoints.single, socket=socket)
    assert (reply["source"], reply["digest"]) == ("cache", tensor_digest(checkpoints.tensors))


def test_stress_attach_release_while_preloading_and_evicting(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """``STRESS_WORKERS`` processes attach and release in a loop for ``STRESS_SECONDS``,
    round robin over three models: ``kept`` (held throughout), ``late`` (remote-preloaded
    a quarter in) and ``gone`` (force-evicted half-way). Every attempt must return
    bitwise the disk tensors; the only fallbacks allowed are the documented ones, at the
    times they are possible."""
    root = tmp_path / "root"
    kept, late, gone = root / "kept", root / "late", root / "gone"
    shutil.copytree(checkpoints.single, kept)
    shutil.copytree(checkpoints.other_sharded, late)
    shutil.copytree(checkpoints.other, gone)
    expected = {str(p): disk_digest(p) for p in (kept, late, gone)}
    daemon = start_ready(
        daemons,
        [kept, gone],
        args=["--allow-remote-preload", "--model-root", str(root), "--drain-timeout", "30"],
    )
    assert set(list_models(daemon.socket)) == {"kept", "gone"}
    kids = children.start(STRESS_WORKERS)
    options = {"socket": daemon.socket, "ttl": 10.0, "wait_timeout": 60.0}
    modes = [{**options, "mode": "zero_copy"}, {**options, "mode": "copy"}]
    plan = [[str(path), mode] for mode in modes for path in (kept, late, gone)]

    for i, kid in enumerate(kids):
        kid.send(
            "stress", plan=plan[i % 6 :] + plan[: i % 6], seconds=STRESS_SECONDS, expected=expected
        )
    started = time.monotonic()
    time.sleep(STRESS_SECONDS / 4)
    preload_start = time.monotonic()
    with service_stub(daemon.socket) as stub:
        progress = list(stub.Preload(pb.PreloadRequest(path=str(late)), timeout=120))
    preload_done = time.monotonic()
    assert (progress[-1].model, progress[-1].state) == ("late", pb.MODEL_STATE_READY)
    time.sleep(max(0.0, started + STRESS_SECONDS / 2 - time.monotonic()))
    evict_start = time.monotonic()
    evict(daemon.socket, "gone", force=True)
    wait_until(lambda: "gone" not in list_models(daemon.socket), 30.0)
    evict_done = time.monotonic()
    assert evict_done < started + STRESS_SECONDS, "the eviction ended after the stress"

    records = [r for kid in kids for r in kid.reply("stress", STRESS_SECONDS + 120)["records"]]
    by_path: dict[str, list[dict[str, Any]]] = {str(p): [] for p in (kept, late, gone)}
    for record in records:
        by_path[record["path"]].append(record)
    assert [r for r in records if "error" in r] == []
    assert all(r["equal"] for r in records)
    outcomes = {(r["source"], r["code"]) for r in records}
    assert outcomes <= {
        ("cache", None),
        ("disk", "MODEL_NOT_FOUND"),
        ("disk", "MODEL_FAILED"),
    }, outcomes
    assert {(r["source"], r["code"]) for r in by_path[str(kept)]} == {("cache", None)}
    # late: not held before its Preload began, held once it was READY.
    for r in by_path[str(late)]:
        if r["t1"] < preload_start:
            assert (r["source"], r["code"]) == ("disk", "MODEL_NOT_FOUND"), r
        if r["t0"] > preload_done:
            assert (r["source"], r["code"]) == ("cache", None), r
        if r["source"] == "disk":
            assert r["code"] == "MODEL_NOT_FOUND", r
    # gone: held before the eviction, not found once it left ListModels; in between it
    # may still be EVICTING (MODEL_FAILED, see the report) or attached.
    for r in by_path[str(gone)]:
        if r["t1"] < evict_start:
            assert (r["source"], r["code"]) == ("cache", None), r
        if r["t0"] > evict_done:
            assert (r["source"], r["code"]) == ("disk", "MODEL_NOT_FOUND"), r
    per_path = {p: len(rs) for p, rs in by_path.items()}
    assert min(per_path.values()) >= STRESS_WORKERS, per_path
    for path, phase in ((str(late), preload_done), (str(gone), evict_start)):
        assert any(r["t0"] > phase for r in by_path[path]), f"no attempt on {path} after the event"
    models = list_models(daemon.socket)
    assert {name: (m.state, m.lease_count) for name, m in models.items()} == {
        "kept": (pb.MODEL_STATE_READY, 0),
        "late": (pb.MODEL_STATE_READY, 0),
    }
    assert len(daemon.segments()) == 2
    summary = Counter((Path(r["path"]).name, r["mode"], r["source"], r["code"]) for r in records)
    print(f"stress: {len(records)} attempts by {STRESS_WORKERS} workers: {sorted(summary.items())}")


def test_a_daemon_on_another_socket_removes_a_sigkilled_daemons_segments(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    crashed = start_ready(daemons, [checkpoints.single, checkpoints.other])
    live = start_ready(daemons, [checkpoints.sharded])
    stale = crashed.segments()
    [kept] = live.segments()
    assert len(stale) == 2
    crashed.kill()

    fresh = start_ready(daemons, socket=daemons.socket("elsewhere"))

    assert crashed.segments() == []
    log = fresh.log().splitlines()
    for path in stale:
        assert any(REMOVED_SEGMENT in line and path in line for line in log), path
    assert live.segments() == [kept]  # a live daemon's segments stay
    assert kept not in fresh.log()
    assert health(live.socket) == "SERVING"
