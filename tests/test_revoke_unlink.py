"""Revocation on shared memory without copies (issue 26, item 1).

A forced evict or a drain at SIGTERM drops the model at once and unlinks its segment; the
workers holding it (default ``on_revoke="keep"``) keep their mappings, with no copy: their
private memory stays flat and their bytes unchanged. Until they close, the daemon shows
the unlinked bytes (``ls``, ``info``, the metrics) and counts them against its budget.

Workers are forked from one zygote per module (``tests/fault_worker.py``).
"""

from __future__ import annotations

import signal
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fault_support import (
    Child,
    Children,
    evict,
    list_models,
    proc_status,
    refused,
    server_info,
    start_ready,
    unlinked,
    write_big_checkpoint,
)
from tests.support import DaemonPool, rpc_failure, run_cli, service_stub, wait_until
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.budget import cpu_available_bytes

pytestmark = pytest.mark.timeout(300)

LONG_TTL = 60.0
MIB = 2**20
#: Private memory a worker may gain across a revoke: allocator noise, not a copy (the
#: model is 128 MiB).
RSS_SLACK = 8 * MIB
TENSOR_MIB = 16
TENSORS = 8


def big_model(root: Path) -> tuple[Path, str, int]:
    """A 128 MiB checkpoint ``root/big``: its folder, digest and bytes."""
    if cpu_available_bytes() < 2 * 2**30:
        pytest.skip("needs 2 GiB of available memory and /dev/shm for a 128 MiB checkpoint")
    digest, total, _ = write_big_checkpoint(
        root / "big", tensors=TENSORS, tensor_mib=TENSOR_MIB, largest_mib=TENSOR_MIB
    )
    return root / "big", digest, total


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    return big_model(tmp_path_factory.mktemp("revoke"))


def attach(kid: Child, path: Path, expected: str, socket: str) -> None:
    reply = kid.load(path, key="w", socket=socket, ttl=LONG_TTL)
    assert reply["ok"], reply
    assert (reply["source"], reply["fallback_reason"], reply["digest"]) == ("cache", None, expected)
    assert kid.request("wait_ack", key="w", seconds=LONG_TTL / 3 + 10)["ok"]


def rss_anon(kid: Child) -> int:
    return proc_status(kid.pid)["RssAnon"]


def assert_kept(kid: Child, expected: str, rss_before: int) -> None:
    """``kid``'s lease was revoked and kept: not lost, no copy (no private page of the
    mapping, private memory flat), bytes unchanged."""
    state = kid.request("lease", key="w")
    state.pop("instance_id")
    assert state == {"reply": "lease", "ok": True, "lost": None, "revoked": True, "kept": True}
    now = kid.request("digest", key="w")
    assert (now["digest"], now["tensors_error"]) == (expected, None)
    [mapping] = kid.request("maps")["maps"]
    assert mapping["deleted"] is True
    assert mapping["Private_Dirty"] == 0, mapping
    assert abs(rss_anon(kid) - rss_before) < RSS_SLACK, (rss_anon(kid), rss_before)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def logged_at(log: str, event: str) -> float:
    """Epoch seconds of the first console log line of ``event``."""
    for line in log.splitlines():
        stamp, _, rest = line.partition(" ")
        if rest.split("]", 1)[-1].split()[:1] == [event]:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no {event!r} line in:\n{log}")


def shmem() -> int:
    """The host's shared memory (``Shmem`` of /proc/meminfo), in bytes."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def test_forced_evict_unlinks_without_copies_and_counts_the_mapped_bytes(
    daemons: DaemonPool, children: Children, big: tuple[Path, str, int], tmp_path: Path
) -> None:
    path, expected, total = big
    remote = ["--allow-remote-preload", "--model-root", str(path.parent)]
    daemon = start_ready(
        daemons,
        [path],
        args=[
            *remote,
            "--metrics-listen",
            "127.0.0.1:0",
            "--max-memory",
            str(total * 3 // 2),
            "--drain-timeout",
            "60",
        ],
    )
    metrics = daemon.bound_port("metrics")
    size = list_models(daemon.socket)["big"].size_bytes
    kids = children.start(2)
    for kid in kids:
        attach(kid, path, expected, daemon.socket)
    before = [rss_anon(kid) for kid in kids]
    shm_before = shmem()

    snapshot = evict(daemon.socket, "big", force=True).model
    assert (snapshot.name, snapshot.lease_count) == ("big", 2)

    # Dropped at once: no model, no segment in /dev/shm, the bytes listed as unlinked.
    assert list_models(daemon.socket) == {}
    assert daemon.segments() == []
    assert unlinked(daemon.socket) == [("big", size, 2)]
    info = server_info(daemon.socket)
    assert (info.memory_held_bytes, info.memory_unlinked_bytes) == (0, size)
    sample = scrape(metrics)
    assert (sample["weightcache_memory_unlinked_bytes"], sample["weightcache_unlinked_arenas"]) == (
        size,
        1,
    )
    for kid, rss in zip(kids, before, strict=True):
        wait_until(lambda: bool(kid.request("lease", key="w")["revoked"]), 30.0)  # noqa: B023
        assert_kept(kid, expected, rss)
    # The host's shared memory did not grow by a copy (others' tests may move it a bit).
    print(f"Shmem {shm_before} -> {shmem()} bytes across the revoke of {size} bytes")
    assert "revoked: segment unlinked, workers keep their mappings" in daemon.log()
    ls = run_cli("ls", "--socket", daemon.socket)
    assert size == 128 * 2**20
    assert "big: unlinked, 128.0MiB still mapped by 2 revoked lease(s)" in ls.stdout

    # Admission counts the mapped bytes: the same model again does not fit 1.5 x its size.
    with service_stub(daemon.socket) as stub:
        error = refused(lambda: list(stub.Preload(pb.PreloadRequest(path=str(path)), timeout=60)))
    failure = rpc_failure(error)
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
    )
    assert failure.metadata["unlinked"] == str(size), failure.metadata

    # Each close releases a revoked lease; the last one frees the accounting.
    kids[0].request("close", key="w")
    wait_until(lambda: unlinked(daemon.socket) == [("big", size, 1)], 10.0)
    kids[1].request("close", key="w")
    wait_until(lambda: unlinked(daemon.socket) == [], 10.0)
    assert server_info(daemon.socket).memory_unlinked_bytes == 0
    assert scrape(metrics)["weightcache_memory_unlinked_bytes"] == 0
    # Now it fits again (the failed record of the refusal is replaced).
    with service_stub(daemon.socket) as stub:
        last = list(stub.Preload(pb.PreloadRequest(path=str(path)), timeout=120))[-1]
    assert last.state == pb.MODEL_STATE_READY


def test_sigterm_drain_exits_at_once_and_holders_keep_their_bytes_without_copies(
    daemons: DaemonPool, children: Children, big: tuple[Path, str, int]
) -> None:
    path, expected, _ = big
    drain_timeout = 60.0
    daemon = start_ready(daemons, [path], args=["--drain-timeout", str(drain_timeout)])
    kids = children.start(2)
    for kid in kids:
        attach(kid, path, expected, daemon.socket)
    before = [rss_anon(kid) for kid in kids]

    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(drain_timeout) == 0
    took = time.monotonic() - sent

    # The holders renew their revoked leases at once, keeping the unlinked segment's
    # bytes: nothing more to wait for (copying holders made this N copies long).
    log = daemon.log()
    drained = logged_at(log, "stopped") - logged_at(log, "draining")
    print(f"SIGTERM to exit {took:.2f} s; draining to stopped {drained:.3f} s (daemon clock)")
    assert drained < 5.0, log
    assert "leases_kept=2 leases_left=0" in log
    assert daemon.leftovers() == []
    for kid, rss in zip(kids, before, strict=True):
        assert_kept(kid, expected, rss)
        assert kid.request("close", key="w") == {"reply": "close", "ok": True}
