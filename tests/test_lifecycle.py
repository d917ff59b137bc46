"""The daemon's life cycle with workers attached: drain at SIGTERM, forced eviction, the
memory budget, start-up while a model loads, and peak memory while preloading.

Workers are forked from one zygote per module (see ``tests/fault_worker.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

from tests.fault_support import (
    Child,
    Children,
    acquire_request,
    disk_digest,
    evict,
    list_models,
    proc_status,
    refused,
    server_info,
    start_ready,
    unlinked,
    write_big_checkpoint,
    write_sized_checkpoint,
)
from tests.recipe_support import children_env, environ
from tests.support import (
    Checkpoints,
    Daemon,
    DaemonPool,
    RpcFailure,
    get_model,
    health,
    private_segments,
    private_shm,
    rpc_failure,
    service_stub,
    shm_segments,
    wait_until,
)
from weightcache.testing import READY_TIMEOUT
from weightcache.testing.protocol import tensor_digest
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.budget import cpu_available_bytes

pytestmark = pytest.mark.timeout(300)

READY = READY_TIMEOUT  # the harness's one ready timeout
LONG_TTL = 60.0
#: Seconds a drain may overrun its timeout: scheduling on a loaded 2-core machine.
DRAIN_SLACK = 1.5
MIB = 2**20


@dataclass(frozen=True)
class Big:
    """A checkpoint big enough that loading it takes a moment.

    Attributes:
        root: a folder holding only ``path`` (a ``--model-root``).
        path: its folder (model name ``big``).
        digest: :func:`tensor_digest` of its tensors.
        total: bytes of all tensors.
        largest: bytes of the largest tensor.
    """

    root: Path
    path: Path
    digest: str
    total: int
    largest: int


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Big:
    """19 tensors of 16 MiB and one of 32 MiB: 336 MiB."""
    if cpu_available_bytes() < 4 * 2**30:
        pytest.skip("needs 4 GiB of available memory and /dev/shm for a 336 MiB checkpoint")
    root = tmp_path_factory.mktemp("big")
    digest, total, largest = write_big_checkpoint(
        root / "big", tensors=20, tensor_mib=16, largest_mib=32
    )
    return Big(root, root / "big", digest, total, largest)


def attach(kid: Child, path: Path, expected: str, key: str = "w", **options: Any) -> dict[str, Any]:
    """Load ``path`` zero-copy in ``kid``: it must attach, bitwise, and its lease be bound
    to its KeepAlive stream."""
    reply = kid.load(path, key=key, **options)
    assert reply["ok"], reply
    assert (reply["source"], reply["fallback_reason"], reply["digest"]) == ("cache", None, expected)
    assert kid.request("wait_ack", key=key, seconds=LONG_TTL / 3 + 10)["ok"]
    return reply


def sigterm(daemon: Daemon) -> float:
    """Send SIGTERM; returns ``time.monotonic()`` just before."""
    at = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    return at


def assert_gone(daemon: Daemon) -> None:
    """The daemon left no socket, lock file or segment."""
    assert not os.path.lexists(daemon.socket)
    assert not os.path.lexists(daemon.socket + ".lock")
    assert shm_segments(daemon.tag) == []


def assert_private_copy(kid: Child, segment: str) -> None:
    """``kid`` still maps the (now unlinked) segment, every page a private copy."""
    [mapping] = kid.request("maps")["maps"]
    assert (mapping["path"], mapping["deleted"]) == (segment, True)
    assert mapping["Private_Dirty"] == mapping["Rss"] == mapping["Size"] > 0, mapping


# -- drain at SIGTERM -------------------------------------------------------------------


def assert_revoked_copy(kid: Child, expected: str, segment: str) -> None:
    """The worker's lease was revoked and handled by copying: not lost, its tensors'
    digest still ``expected`` and no error, its copy out of ``segment``."""
    state = kid.request("lease", key="w")
    state.pop("instance_id")
    assert state == {"reply": "lease", "ok": True, "lost": None, "revoked": True, "kept": False}
    now = kid.request("digest", key="w")
    assert (now["digest"], now["tensors_error"]) == (expected, None)
    assert_private_copy(kid, segment)


def test_sigterm_copy_holders_release_daemon_exits_well_before_drain_timeout(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    drain_timeout = 60.0
    daemon = start_ready(
        daemons, [checkpoints.sharded], args=["--drain-timeout", str(drain_timeout)]
    )
    expected = tensor_digest(checkpoints.tensors)
    kids = children.start(3)
    for kid in kids:
        attach(
            kid,
            checkpoints.sharded,
            expected,
            socket=daemon.socket,
            ttl=LONG_TTL,
            on_revoke="copy",
            lease_policy="raise",
            lost_callback=True,
        )
    assert get_model(daemon.socket, "sharded").lease_count == 3
    [segment] = daemon.segments()

    sent = sigterm(daemon)
    assert daemon.proc.wait(drain_timeout + 30) == 0
    took = time.monotonic() - sent

    # Every holder copied and released, so the drain ended long before its timeout.
    assert took < drain_timeout / 2, took
    print(f"drained with copying holders in {took:.2f} s (timeout {drain_timeout} s)")
    log = daemon.log()
    assert "draining" in log
    assert "leases_left=0" in log
    assert_gone(daemon)
    for kid in kids:
        # Revoked and handled by copying: not lost, even now that the stream has broken.
        assert_revoked_copy(kid, expected, segment)
        assert "lease revoked: weights copied to private memory" in kid.log()


def test_sigterm_raise_holder_loses_lease_stopped_holder_holds_drain_to_its_timeout(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    drain_timeout = 10.0
    daemon = start_ready(
        daemons, [checkpoints.single], args=["--drain-timeout", str(drain_timeout)]
    )
    expected = tensor_digest(checkpoints.tensors)
    raiser, stopped, late = children.start(3)
    attach(
        raiser,
        checkpoints.single,
        expected,
        socket=daemon.socket,
        ttl=LONG_TTL,
        lease_policy="raise",
        on_revoke="raise",
        lost_callback=True,
    )
    attach(stopped, checkpoints.single, expected, socket=daemon.socket, ttl=LONG_TTL)
    stopped.stop()
    acquire = acquire_request(checkpoints.single)

    sent = sigterm(daemon)

    event = raiser.event("lease_lost", timeout=drain_timeout)
    assert event["error"]["reason"] == "LEASE_LOST"
    assert "revoking" in event["error"]["detail"]
    now = raiser.request("digest", key="w")
    assert now["digest"] == expected  # the mapping stays readable on CPU
    assert (now["tensors_error"]["type"], now["tensors_error"]["reason"]) == (
        "LeaseLostError",
        "LEASE_LOST",
    )
    # While it drains: not ready, and no new lease.
    assert health(daemon.socket) == "NOT_SERVING"
    with service_stub(daemon.socket) as stub:
        failure = rpc_failure(refused(lambda: stub.Acquire(acquire, timeout=10)))
    assert (failure.code, failure.reason) == (grpc.StatusCode.UNAVAILABLE, "DRAINING")
    fell_back = late.load(checkpoints.single, socket=daemon.socket)
    assert (fell_back["source"], fell_back["fallback_reason"]["code"]) == ("disk", "DRAINING")
    assert fell_back["digest"] == expected
    assert daemon.proc.poll() is None, "the daemon exited before the checks ended"

    # Neither holder released: the daemon waits out the drain timeout, then exits.
    assert daemon.proc.wait(drain_timeout + 60) == 0
    took = time.monotonic() - sent
    assert drain_timeout <= took <= drain_timeout + 30, took
    print(f"drained with a stopped holder in {took:.2f} s (timeout {drain_timeout} s)")
    assert_gone(daemon)
    stopped.signal(signal.SIGCONT)
    resumed = stopped.request("digest", key="w")
    assert (resumed["digest"], resumed["tensors_error"]) == (expected, None)


def test_close_after_the_daemon_drained_is_a_no_op(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    daemon = start_ready(daemons, [checkpoints.single], args=["--drain-timeout", "60"])
    kid = children.one()
    attach(kid, checkpoints.single, tensor_digest(checkpoints.tensors), socket=daemon.socket)
    sigterm(daemon)
    assert daemon.proc.wait(90) == 0
    assert kid.request("lease", key="w")["revoked"] is True

    closed = kid.request("close", key="w")

    assert closed == {"reply": "close", "ok": True}, closed


# -- forced eviction --------------------------------------------------------------------


def test_forced_evict_unlinks_at_once_and_copy_holders_release(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    daemon = start_ready(
        daemons, [checkpoints.single, checkpoints.other], args=["--drain-timeout", "60"]
    )
    expected = tensor_digest(checkpoints.tensors)
    assert len(daemon.segments()) == 2
    quick, stopped, late = children.start(3)
    options: dict[str, Any] = {
        "socket": daemon.socket,
        "ttl": LONG_TTL,
        "on_revoke": "copy",
        "lost_callback": True,
    }
    attach(quick, checkpoints.single, expected, **options)
    attach(stopped, checkpoints.single, expected, **options)
    segments = set(daemon.segments())
    assert get_model(daemon.socket, "single").lease_count == 2

    # Without holders a forced evict frees at once.
    snapshot = evict(daemon.socket, "other", force=True).model
    assert (snapshot.name, snapshot.lease_count) == ("other", 0)
    assert set(list_models(daemon.socket)) == {"single"}
    [segment] = daemon.segments()
    assert segment in segments

    # With holders: REVOKING. On shared memory the model is dropped at once and its
    # segment unlinked under the holders' mappings; listed as unlinked until they release.
    stopped.stop()
    snapshot = evict(daemon.socket, "single", force=True).model
    assert (snapshot.name, snapshot.state, snapshot.lease_count) == (
        "single",
        pb.MODEL_STATE_READY,
        2,
    )
    size = snapshot.size_bytes
    assert list_models(daemon.socket) == {}
    assert daemon.segments() == []
    wait_until(lambda: quick.request("lease", key="w")["revoked"], 30.0)
    wait_until(lambda: unlinked(daemon.socket) == [("single", size, 1)], 30.0)
    fell_back = late.load(checkpoints.single, socket=daemon.socket)
    assert (fell_back["source"], fell_back["fallback_reason"]["code"]) == (
        "disk",
        "MODEL_NOT_FOUND",
    )
    assert fell_back["digest"] == expected

    stopped.signal(signal.SIGCONT)
    wait_until(lambda: unlinked(daemon.socket) == [], 30.0)
    for kid in (quick, stopped):
        assert_revoked_copy(kid, expected, segment)


# -- memory budget ----------------------------------------------------------------------


def test_budget_refuses_a_preload_over_it_and_disturbs_nothing(
    daemons: DaemonPool, children: Children, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    first = write_sized_checkpoint(root / "first", MIB, seed=1)
    second = write_sized_checkpoint(root / "second", 2 * MIB, seed=2)
    remote = ["--allow-remote-preload", "--model-root", str(root)]
    budgeted = daemons.start([first], args=[*remote, "--max-memory", "2MiB"], wait=False)
    # A headroom no machine has: even the start-up preload is refused, and it serves.
    headroom = 2**50
    cramped = daemons.start([first], args=[*remote, "--headroom", str(headroom)], wait=False)
    budgeted.wait_ready(READY)
    cramped.wait_ready(READY)

    info = server_info(budgeted.socket)
    assert (info.memory_budget_bytes, info.memory_held_bytes) == (2 * MIB, MIB)
    with service_stub(budgeted.socket) as stub:
        error = refused(lambda: list(stub.Preload(pb.PreloadRequest(path=str(second)), timeout=60)))
    failure = rpc_failure(error)
    assert (failure.code, failure.reason, failure.domain) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
        "weightcache.v1",
    )
    assert failure.message == (
        f"second needs {2 * MIB} bytes; {MIB} of the {2 * MIB}-byte budget are held"
    )
    assert failure.metadata == {"needed": str(2 * MIB), "held": str(MIB), "budget": str(2 * MIB)}
    # The refusal is kept (FAILED, no arena): a worker asking for it learns why.
    models = list_models(budgeted.socket)
    assert {n: (m.state, m.size_bytes, m.error) for n, m in models.items()} == {
        "first": (pb.MODEL_STATE_READY, MIB, ""),
        "second": (pb.MODEL_STATE_FAILED, 2 * MIB, failure.message),
    }
    assert server_info(budgeted.socket).memory_held_bytes == MIB
    assert len(budgeted.segments()) == 1
    kid = children.one()
    reply = kid.load(first, socket=budgeted.socket)
    assert (reply["source"], reply["digest"]) == ("cache", disk_digest(first))
    missing = kid.load(second, key="second", socket=budgeted.socket)
    assert (missing["source"], missing["fallback_reason"]["code"]) == ("disk", "RESOURCE_EXHAUSTED")
    assert missing["digest"] == disk_digest(second)

    # A start-up preload refused for lack of memory: the worker gets that reason, and a
    # raw Acquire the exact ErrorInfo; not MODEL_NOT_FOUND.
    assert "cannot preload" in cramped.log()
    assert "RESOURCE_EXHAUSTED" in cramped.log()
    [refusal] = list_models(cramped.socket).values()
    assert (refusal.name, refusal.state) == ("first", pb.MODEL_STATE_FAILED)
    assert refusal.error.startswith(f"first needs {MIB} bytes plus {headroom} of headroom; ")
    cramped_reply = kid.load(first, key="cramped", socket=cramped.socket)
    assert (cramped_reply["source"], cramped_reply["fallback_reason"]["code"]) == (
        "disk",
        "RESOURCE_EXHAUSTED",
    )
    with service_stub(cramped.socket) as stub:
        error = refused(lambda: stub.Acquire(acquire_request(first), timeout=10))
    failure = rpc_failure(error)
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
    )
    assert failure.message == f"model 'first' was not loaded: {refusal.error}"
    assert failure.metadata == {
        "model": "first",
        "needed": str(MIB),
        "headroom": str(headroom),
        "available": failure.metadata["available"],
    }
    with service_stub(cramped.socket) as stub:
        error = refused(lambda: list(stub.Preload(pb.PreloadRequest(path=str(first)), timeout=60)))
    failure = rpc_failure(error)
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
    )
    available = int(failure.metadata["available"])
    assert failure.metadata == {
        "needed": str(MIB),
        "headroom": str(headroom),
        "available": str(available),
    }
    assert failure.message == (
        f"first needs {MIB} bytes plus {headroom} of headroom; {available} are available"
    )
    assert cramped.segments() == []
    # Refusals are listed and evicted like any FAILED model.
    assert evict(cramped.socket, "first").model.state == pb.MODEL_STATE_FAILED
    assert list_models(cramped.socket) == {}


def test_a_refused_model_is_not_answered_as_a_mismatch_with_a_look_alike(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    """``sharded`` and ``other_sharded`` share a layout (shard names, sizes, headers); the
    budget holds one. A worker asking for the refused one must learn it was refused, not
    that the held look-alike differs in content."""
    daemon = daemons.start(
        [checkpoints.sharded, checkpoints.other_sharded], args=["--max-memory", "16KiB"]
    )
    models = list_models(daemon.socket)
    assert {n: m.state for n, m in models.items()} == {
        "sharded": pb.MODEL_STATE_READY,
        "other-sharded": pb.MODEL_STATE_FAILED,
    }
    assert "failed=1 models=1" in daemon.log()  # counted once, though listed

    with service_stub(daemon.socket) as stub:
        request = acquire_request(checkpoints.other_sharded)
        failure = rpc_failure(refused(lambda: stub.Acquire(request, timeout=10)))
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
    )
    assert failure.metadata["model"] == "other-sharded"
    assert failure.message == (
        f"model 'other-sharded' was not loaded: {models['other-sharded'].error}"
    )
    kid = children.one()
    reply = kid.load(checkpoints.other_sharded, socket=daemon.socket)
    assert (reply["source"], reply["fallback_reason"]["code"]) == ("disk", "RESOURCE_EXHAUSTED")
    assert reply["digest"] == disk_digest(checkpoints.other_sharded)


def test_out_of_inodes_is_resource_exhausted_for_the_worker_too(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    """A private /dev/shm with one free inode: of two start-up models one gets a segment,
    the other cannot even create its file (ENOSPC from open(2))."""
    shm = private_shm("64m", 2)
    paths = {"single": checkpoints.single, "other": checkpoints.other}
    daemon = daemons.start(list(paths.values()), args=["--headroom", "0"], wrap=shm)

    states = {n: (m.state, m.error) for n, m in list_models(daemon.socket).items()}
    [failed] = [n for n, (state, _) in states.items() if state == pb.MODEL_STATE_FAILED]
    [held] = [n for n, (state, _) in states.items() if state == pb.MODEL_STATE_READY]
    error = "cannot create a segment in /dev/shm: No space left on device"
    assert states[failed][1] == error
    assert len(private_segments(daemon.pid)) == 1
    with service_stub(daemon.socket) as stub:
        refusal = rpc_failure(
            refused(lambda: stub.Acquire(acquire_request(paths[failed]), timeout=10))
        )
    assert (refusal.code, refusal.reason, refusal.metadata) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
        {"model": failed, "errno": "ENOSPC"},
    )
    assert refusal.message == f"model {failed!r} was not loaded: {error}"
    kid = children.one()
    reply = kid.load(paths[failed], socket=daemon.socket)
    assert (reply["source"], reply["fallback_reason"]["code"]) == ("disk", "RESOURCE_EXHAUSTED")
    assert reply["digest"] == disk_digest(paths[failed])
    assert held in paths
    assert daemon.stop() == 0


# -- start-up ---------------------------------------------------------------------------


def _poll_acquire(
    socket: str, request: pb.AcquireRequest, on_answer: Callable[[RpcFailure | None], None]
) -> tuple[pb.AcquireResponse, list[RpcFailure]]:
    """Acquire on a fresh channel (as the client does) every few milliseconds until it
    succeeds; returns the response and every refusal that carried an ErrorInfo, that is
    every answer of the daemon before it. ``on_answer`` sees each answer (None: success)."""
    answers: list[RpcFailure] = []
    deadline = time.monotonic() + READY
    while True:
        assert time.monotonic() < deadline, answers
        if os.path.exists(socket):
            with service_stub(socket) as stub:
                try:
                    reply: pb.AcquireResponse = stub.Acquire(request, timeout=10)
                except grpc.RpcError as exc:
                    assert isinstance(exc, grpc.Call)
                    if rpc_status.from_call(exc) is None:  # not listening yet
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    else:
                        answers.append(rpc_failure(exc))
                        on_answer(answers[-1])
                else:
                    stub.Release(pb.ReleaseRequest(lease_id=reply.lease.lease_id), timeout=10)
                    on_answer(None)
                    return reply, answers
        time.sleep(0.005)


def _assert_loading(answers: list[RpcFailure], big: Big) -> None:
    done = [int(a.metadata["bytes_done"]) for a in answers]
    assert done == sorted(done)
    for answer in answers:
        assert (answer.code, answer.reason) == (grpc.StatusCode.UNAVAILABLE, "MODEL_LOADING")
        assert answer.metadata == {
            "model": "big",
            "bytes_done": answer.metadata["bytes_done"],
            "bytes_total": str(big.total),
        }
        assert 0 <= int(answer.metadata["bytes_done"]) < big.total


def test_workers_wait_for_a_starting_daemon_and_a_loading_model(
    daemons: DaemonPool, children: Children, big: Big
) -> None:
    """``early`` (fallback=False) starts before the daemon; ``eager`` (fallback=True) as
    soon as the daemon answers an Acquire for the model still loading. Both must wait and
    attach, not load from disk."""
    early, eager = children.start(2)
    request = acquire_request(big.path)
    socket = daemons.socket("loading")
    options: dict[str, Any] = {
        "socket": socket,
        "ttl": LONG_TTL,
        "wait_timeout": 120.0,
        "capture_logs": True,
    }
    early.send_load(big.path, fallback=False, **options)
    time.sleep(1.0)
    daemon = daemons.start([big.path], socket=socket, wait=False)
    started: list[RpcFailure | None] = []

    def start_eager(answer: RpcFailure | None) -> None:
        # Not on MODEL_NOT_FOUND: see test_acquire_while_start_up_preloads_register_...
        if not started and (answer is None or answer.reason == "MODEL_LOADING"):
            started.append(answer)
            eager.send_load(big.path, **options)

    _, answers = _poll_acquire(socket, request, start_eager)
    replies = {"early": early.reply("load", 180), "eager": eager.reply("load", 180)}
    daemon.wait_ready(READY)

    for name, loaded in replies.items():
        assert loaded["ok"], (name, loaded)
        assert (loaded["source"], loaded["fallback_reason"]) == ("cache", None), name
        assert loaded["digest"] == big.digest, name
    early_waits = [e["reason"] for e in replies["early"]["logs"] if e.get("event") == "waiting"]
    assert set(early_waits) <= {"DAEMON_UNAVAILABLE", "MODEL_LOADING"}, early_waits
    assert replies["early"]["t1"] - replies["early"]["t0"] >= 1.0
    eager_waits = [e["reason"] for e in replies["eager"]["logs"] if e.get("event") == "waiting"]
    assert set(eager_waits) <= {"MODEL_LOADING"}, eager_waits
    # Before the model is registered the daemon may answer MODEL_NOT_FOUND (the bug below)
    # or, while it fingerprints the checkpoint at the default level (full: every byte
    # hashed), MODEL_LOADING naming no model (see the next test); from the first answer
    # naming the model on, only MODEL_LOADING naming it.
    reasons = [a.reason for a in answers]
    named = [i for i, a in enumerate(answers) if "model" in a.metadata]
    loading = named[0] if named else len(answers)
    for early_answer in answers[:loading]:
        assert early_answer.reason in ("MODEL_NOT_FOUND", "MODEL_LOADING"), reasons
        assert "model" not in early_answer.metadata, early_answer
    _assert_loading(answers[loading:], big)
    print(f"answers before the lease: {reasons.count('MODEL_LOADING')} MODEL_LOADING")


def test_acquire_while_start_up_preloads_register_is_model_loading(
    daemons: DaemonPool, big: Big, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--fingerprint-level full`` and an empty hash cache the daemon hashes the
    checkpoint (about a second) before it registers the model; the window is then wide
    enough to hit every time."""
    monkeypatch.setenv("WEIGHTCACHE_HASH_CACHE", str(tmp_path / "client-hashes"))
    request = acquire_request(big.path, "full")
    monkeypatch.setenv("WEIGHTCACHE_HASH_CACHE", str(tmp_path / "daemon-hashes"))
    socket = daemons.socket("hashing")
    daemon = daemons.start(
        [big.path], socket=socket, args=["--fingerprint-level", "full"], wait=False
    )

    _, answers = _poll_acquire(socket, request, lambda _answer: None)
    daemon.wait_ready(READY)

    assert [a.reason for a in answers if a.reason != "MODEL_LOADING"] == []


# -- memory ------------------------------------------------------------------------------


def test_preload_peak_memory_is_arena_plus_one_tensor(daemons: DaemonPool, big: Big) -> None:
    daemon = start_ready(daemons, args=["--allow-remote-preload", "--model-root", str(big.root)])
    idle = proc_status(daemon.pid)["VmHWM"]

    with service_stub(daemon.socket) as stub:
        progress = list(stub.Preload(pb.PreloadRequest(path=str(big.path)), timeout=240))

    peak = proc_status(daemon.pid)["VmHWM"]
    last = progress[-1]
    assert (last.model, last.state) == ("big", pb.MODEL_STATE_READY)
    assert (last.progress.bytes_done, last.progress.bytes_total) == (big.total, big.total)
    arena = list_models(daemon.socket)["big"].size_bytes
    assert arena >= big.total
    grew = peak - idle
    assert grew <= arena + big.largest + 64 * MIB, (grew / MIB, arena / MIB)
    print(
        f"VmHWM idle {idle / MIB:.0f} MiB, after preload {peak / MIB:.0f} MiB (+{grew / MIB:.0f})"
    )


# -- failed loads ------------------------------------------------------------------------


def _truncate_when_loading(progress: Any, shard: Path, keep: int) -> list[pb.PreloadResponse]:
    """Read a Preload stream; at its first LOADING answer, cut ``shard`` to ``keep`` bytes
    (the header stays valid: the daemon checked it before it started reading)."""
    seen: list[pb.PreloadResponse] = []
    for answer in progress:
        if not seen:
            assert answer.state == pb.MODEL_STATE_LOADING, answer
            os.truncate(shard, keep)
        seen.append(answer)
    return seen


def test_a_shard_truncated_while_loading_frees_the_arena_at_once_and_evict_works(
    daemons: DaemonPool, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    write_big_checkpoint(root / "cut", tensors=12, tensor_mib=16, largest_mib=16)
    shard = root / "cut" / "model.safetensors"
    daemon = start_ready(daemons, args=["--allow-remote-preload", "--model-root", str(root)])

    with service_stub(daemon.socket) as stub:
        stream = stub.Preload(pb.PreloadRequest(path=str(root / "cut")), timeout=120)
        failure = rpc_failure(refused(lambda: _truncate_when_loading(stream, shard, MIB)))

    # Freed at once, not at shutdown: no segment right after the failure.
    assert daemon.segments() == []
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CHECKPOINT",
    )
    assert "file ended inside tensor" in failure.message
    [model] = list_models(daemon.socket).values()
    assert (model.name, model.state) == ("cut", pb.MODEL_STATE_FAILED)
    assert model.error == failure.message
    assert server_info(daemon.socket).memory_held_bytes == 0
    snapshot = evict(daemon.socket, "cut").model
    assert (snapshot.name, snapshot.state, snapshot.error) == (
        "cut",
        pb.MODEL_STATE_FAILED,
        failure.message,
    )
    assert list_models(daemon.socket) == {}
    assert daemon.stop() == 0
    assert_gone(daemon)


#: Runs a command with one system call refused by a seccomp filter (see its docstring).
REFUSE_SYSCALL = Path(__file__).with_name("refuse_syscall.py")
#: Exits 0 when os.sendfile fails with the errno named in argv[1], 3 on another errno,
#: 4 when it succeeds.
SENDFILE_PROBE = """
import errno, os, sys, tempfile
with tempfile.TemporaryFile() as src, tempfile.TemporaryFile() as dst:
    src.write(b"x")
    src.flush()
    try:
        os.sendfile(dst.fileno(), src.fileno(), 0, 1)
    except OSError as exc:
        sys.exit(0 if exc.errno == getattr(errno, sys.argv[1]) else 3)
    sys.exit(4)
"""


def refusing_sendfile(error: str) -> list[str]:
    """A command prefix that runs its command (by exec, same pid) with every sendfile(2)
    failing with errno ``error``, as under a seccomp sandbox; checked with a probe process
    first. Skips the test where the filter cannot be installed."""
    wrap = [sys.executable, str(REFUSE_SYSCALL), "sendfile", error]
    probe = subprocess.run(
        [*wrap, sys.executable, "-c", SENDFILE_PROBE, error], capture_output=True, check=False
    )
    if probe.returncode == 2:
        pytest.skip(f"cannot install a seccomp filter: {probe.stderr.decode(errors='replace')}")
    assert probe.returncode == 0, (probe.returncode, probe.stderr)
    return wrap


@pytest.mark.parametrize("error", ["EPERM", "EINVAL"])
def test_preload_with_sendfile_refused_reads_instead_bitwise_equal(
    daemons: DaemonPool, children: Children, big: Big, error: str
) -> None:
    """Stored tensors are copied into the arena by sendfile(2); where the kernel refuses
    it (a sandbox's EPERM, EINVAL for files it cannot splice) the load reads them instead."""
    daemon = daemons.start([big.path], wrap=refusing_sendfile(error))

    # The daemon itself runs filtered (Seccomp: 2, filter mode; proc(5)).
    assert "Seccomp:\t2\n" in Path(f"/proc/{daemon.pid}/status").read_text()
    model = get_model(daemon.socket, "big")
    assert (model.state, model.error) == (pb.MODEL_STATE_READY, "")
    progress = model.progress
    assert (progress.bytes_done, progress.bytes_total) == (big.total, big.total)
    assert (progress.tensors_done, progress.tensors_total) == (20, 20)
    attach(children.one(), big.path, disk_digest(big.path), socket=daemon.socket)
    assert daemon.stop() == 0
    assert_gone(daemon)


def test_a_plugin_that_raises_while_loading_frees_the_arena_at_once(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(checkpoints.single, root / "single")
    remote = ["--allow-remote-preload", "--model-root", str(root), "--allow-recipe", "fail_at"]
    with environ(children_env(tmp_path / "hashes")):
        daemon = start_ready(daemons, args=remote)
    plugin = pb.RecipePlugin(name="fail_at", params={"tensor": "layers.0.mlp.weight"})
    request = pb.PreloadRequest(path=str(root / "single"), recipe=pb.Recipe(plugins=[plugin]))

    with service_stub(daemon.socket) as stub:
        failure = rpc_failure(refused(lambda: list(stub.Preload(request, timeout=60))))

    assert daemon.segments() == []
    assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MODEL_FAILED")
    assert failure.message == (
        "single: RuntimeError: fail_at: planted failure in layers.0.mlp.weight"
    )
    [model] = list_models(daemon.socket).values()
    assert (model.name, model.state, model.error) == (
        "single",
        pb.MODEL_STATE_FAILED,
        failure.message,
    )
    assert evict(daemon.socket, "single").model.state == pb.MODEL_STATE_FAILED
    assert list_models(daemon.socket) == {}
    assert health(daemon.socket) == "SERVING"


def test_sigterm_while_a_model_loads_frees_its_arena_and_exits_cleanly(
    daemons: DaemonPool, big: Big
) -> None:
    daemon = daemons.start([big.path], wait=False)
    wait_until(
        lambda: (
            health(daemon.socket) is not None
            and "big" in list_models(daemon.socket)
            and list_models(daemon.socket)["big"].progress.bytes_done > 0
        ),
        READY,
        interval=0.01,
    )
    assert get_model(daemon.socket, "big").state == pb.MODEL_STATE_LOADING

    sigterm(daemon)

    assert daemon.proc.wait(60) == 0
    assert "cancelled at shutdown" in daemon.log()
    assert_gone(daemon)


def _logged_at(log: str, event: str) -> float:
    """Seconds since the epoch of the first log line of ``event`` (console format: an ISO
    8601 UTC time stamp, the level, the event)."""
    for line in log.splitlines():
        stamp, _, rest = line.partition(" ")
        if rest.split("]", 1)[-1].split()[:1] == [event]:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no {event!r} line in:\n{log}")


def test_drain_with_a_holder_that_never_releases_exits_on_time(
    daemons: DaemonPool, children: Children, checkpoints: Checkpoints
) -> None:
    """The drain timeout bounds the shutdown: the daemon exits within it plus scheduling
    slack, not seconds later."""
    drain_timeout = 3.0
    daemon = start_ready(
        daemons, [checkpoints.single], args=["--drain-timeout", str(drain_timeout)]
    )
    stopped = children.one()
    attach(stopped, checkpoints.single, tensor_digest(checkpoints.tensors), socket=daemon.socket)
    stopped.stop()

    sent = sigterm(daemon)
    assert daemon.proc.wait(drain_timeout + 60) == 0
    took = time.monotonic() - sent

    log = daemon.log()
    stopped_after = _logged_at(log, "stopped") - _logged_at(log, "draining")
    print(f"stopped {stopped_after:.2f} s, exited {took:.2f} s after SIGTERM")
    # The daemon's own clock: the shutdown ends with the drain timeout (it used to add
    # the full second of gRPC grace on top, waiting on the stopped holder's stream).
    assert drain_timeout <= stopped_after <= drain_timeout + 0.5, log
    # The wall clock adds the interpreter's exit, slower on a loaded machine.
    assert drain_timeout <= took <= drain_timeout + DRAIN_SLACK, took
    assert_gone(daemon)
    stopped.signal(signal.SIGCONT)
