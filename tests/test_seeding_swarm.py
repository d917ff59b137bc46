"""Seeding from several peers at once (issue 40, Build 2): a daemon in namespace B fills a
model from the daemons in namespaces A and C together, each joined to B by a veth pair of
its own, verified by content (docs/seeding.md, "Several peers").

Namespaces, pairs and addresses are made as root and removed after, as in
``tests/test_seeding.py`` (whose helpers this reuses); without root or ``ip`` these are
skipped, saying so.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.security_support import Pki, make_pki
from tests.test_seeding import (
    PORT,
    SEED_FAILED,
    Node,
    _checkpoint,
    _copies,
    _events,
    _ip,
    _model,
    _model_digest,
    _running,
    _segments,
    _worker_in,
    netns_only,
    room,
)
from weightcache.testing.daemon import Daemon
from weightcache.v1 import weight_cache_service_pb2 as pb

__all__ = ["room"]  # the fixture, imported to be found here


@dataclass(frozen=True)
class Trio:
    """Namespaces A and C (the peers) and B (the seeder); B reaches A at ``a_ip`` over
    one veth pair and C at ``c_ip`` over another."""

    ns_a: str
    ns_b: str
    ns_c: str
    a_ip: str
    c_ip: str


@pytest.fixture
def trio() -> Iterator[Trio]:
    """Namespaces ``wcsa-``, ``wcsb-``, ``wcsc-<hex>`` and two veth pairs, removed after."""
    tag = uuid.uuid4().hex[:6]
    net = int(tag[:2], 16)
    made = Trio(f"wcsa-{tag}", f"wcsb-{tag}", f"wcsc-{tag}", f"10.232.{net}.1", f"10.233.{net}.1")
    created: list[str] = []
    try:
        for ns in (made.ns_a, made.ns_b, made.ns_c):
            _ip("netns", "add", ns)
            created.append(ns)
        for peer_ns, side, address, subnet in (
            (made.ns_a, "a", made.a_ip, f"10.232.{net}"),
            (made.ns_c, "c", made.c_ip, f"10.233.{net}"),
        ):
            there, here = f"wcs{side}{tag}", f"wcb{side}{tag}"
            _ip("link", "add", there, "type", "veth", "peer", "name", here)
            for ns, dev, ip in ((peer_ns, there, address), (made.ns_b, here, f"{subnet}.2")):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        for ns in created:
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns in created:  # deleting a namespace deletes its veth ends, and the pairs
            _ip("netns", "del", ns)
        for side in ("a", "c"):
            with contextlib.suppress(AssertionError):
                _ip("link", "del", f"wcs{side}{tag}")  # only if it never moved


@pytest.fixture
def pki3(room: Path, trio: Trio) -> Pki:
    """A CA, a server certificate for A's and C's addresses, client certificates."""
    return make_pki(room / "pki", [trio.a_ip, trio.c_ip])


def _three(room: Path, trio: Trio, big: bool = False) -> tuple[Node, Node, Node]:
    a, b, c = _copies(room, _checkpoint(room, big), [trio.ns_a, trio.ns_b, trio.ns_c])
    return a, b, c


def _serving(pki: Pki, ip: str, *extra: str) -> list[str]:
    return [
        "--listen", f"{ip}:{PORT}", "--tls-cert", str(pki.server_cert),
        "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca), "--allow-seeding",
        *extra,
    ]  # fmt: skip


def _seeding(pki: Pki, trio: Trio, *extra: str) -> list[str]:
    return [
        "--seed-from", f"{trio.a_ip}:{PORT},{trio.c_ip}:{PORT}",
        "--peer-tls-cert", str(pki.client_cert), "--peer-tls-key", str(pki.client_key),
        "--peer-tls-ca", str(pki.ca), *extra,
    ]  # fmt: skip


@netns_only
@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_seeds_from_two_peers_at_once(room: Path, trio: Trio, pki3: Pki, plane: str) -> None:
    a_node, b_node, c_node = _three(room, trio)
    with (
        _running(a_node, _serving(pki3, trio.a_ip)),
        _running(c_node, _serving(pki3, trio.c_ip)),
        _running(b_node, _seeding(pki3, trio, "--seed-plane", plane)) as b,
    ):
        model = _model(b)
        [seeded] = _events(b, "seeded")
        worker = _worker_in(b_node, b)  # bitwise against safetensors reading the files

    pa, pc = f"{trio.a_ip}:{PORT}", f"{trio.c_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {pa},{pc}")
    assert model.fingerprint.digest == _model_digest(a_node)
    # One piece per shard; A is dealt the first, C the second: both served.
    assert (seeded["pieces"], seeded["dropped"], seeded["plane"]) == ({pa: 1, pc: 1}, {}, plane)
    assert seeded["bytes"] == model.size_bytes
    assert worker == {"source": "cache", "tensors": 9}
    assert _events(b, SEED_FAILED) == []


def _wait_for_piece_from(b: Daemon, peer: str) -> None:
    """Until B logs that a piece from ``peer`` landed (``--log-level debug``)."""
    deadline = time.monotonic() + 60
    while not any(e["peer"] == peer for e in _events(b, "seed piece")):
        assert b.proc.poll() is None and time.monotonic() < deadline, b.log()
        time.sleep(0.05)


@netns_only
def test_a_peer_killed_mid_seed_leaves_the_rest_to_the_other(
    room: Path, trio: Trio, pki3: Pki
) -> None:
    a_node, b_node, c_node = _three(room, trio, big=True)
    # One connection per peer; 8 MiB in eight 1 MiB pieces, A dealt the even ones. A sends
    # at 128 KiB/s, so each of its pieces takes 8 s, and C may steal any of A's but its last
    # one: when A's first piece has landed, another is still A's, and A is killed then. The
    # kill must come within those 8 s of the log line; a test process stalled longer on a
    # loaded host fails the pieces' assertion, it cannot pass wrongly.
    slow = _serving(pki3, trio.a_ip, "--seed-max-rate", str(128 << 10))
    seeding = _seeding(pki3, trio, "--seed-streams", "1", "--log-level", "debug")
    with (
        _running(a_node, slow) as a,
        _running(c_node, _serving(pki3, trio.c_ip)),
        _running(b_node, seeding, wait=False) as b,
    ):
        _wait_for_piece_from(b, f"{trio.a_ip}:{PORT}")
        a.kill()
        b.wait_ready(models=1)
        model = _model(b)
        [seeded] = _events(b, "seeded")
        [dropped] = _events(b, "seed peer dropped")
        worker = _worker_in(b_node, b)

    pa, pc = f"{trio.a_ip}:{PORT}", f"{trio.c_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {pa},{pc}")
    assert model.fingerprint.digest == _model_digest(b_node)
    assert (seeded["pieces"], seeded["dropped"]) == ({pa: 1, pc: 7}, {pa: "transfer"})
    assert (dropped["peer"], dropped["result"]) == (pa, "transfer")
    assert str(dropped["why"]).startswith("data connection: ")
    assert _events(b, SEED_FAILED) == []  # no fallback to the files
    assert worker == {"source": "cache", "tensors": 8}


@netns_only
def test_a_lying_peer_is_caught_and_its_shard_pulled_from_the_other(
    room: Path, trio: Trio, pki3: Pki
) -> None:
    a_node, b_node, c_node = _three(room, trio)
    with (
        _running(a_node, _serving(pki3, trio.a_ip)) as a,
        _running(c_node, _serving(pki3, trio.c_ip)),
    ):
        [segment] = _segments(a)
        with open(segment, "r+b") as fh:  # the first tensor's first byte: in shard 1
            first = fh.read(1)
            fh.seek(0)
            fh.write(bytes([first[0] ^ 0xFF]))
        with _running(b_node, _seeding(pki3, trio)) as b:
            model = _model(b)
            [seeded] = _events(b, "seeded")
            [dropped] = _events(b, "seed peer dropped")
            worker = _worker_in(b_node, b)

    pa, pc = f"{trio.a_ip}:{PORT}", f"{trio.c_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {pc}")
    assert model.fingerprint.digest == _model_digest(b_node)
    # A, dealt shard 1, sent its corrupted bytes; C sent shard 2, then shard 1 again.
    assert (dropped["peer"], dropped["result"], dropped["why"]) == (
        pa,
        "mismatch",
        "shard model-00001-of-00002.safetensors: the bytes it sent fail the shard's sha256",
    )
    assert (seeded["pieces"], seeded["dropped"]) == ({pc: 2}, {pa: "mismatch"})
    assert _events(b, SEED_FAILED) == []
    assert worker == {"source": "cache", "tensors": 9}


@netns_only
def test_a_stalled_peer_times_out_to_the_other(room: Path, trio: Trio, pki3: Pki) -> None:
    a_node, b_node, c_node = _three(room, trio)
    # A answers BeginSeed, then sends 1 byte/s: its first 64 KiB chunk is due in 18 hours.
    stalling = _serving(pki3, trio.a_ip, "--seed-max-rate", "1")
    seeding = _seeding(
        pki3, trio, "--seed-chunk-bytes", "65536", "--seed-stall-timeout", "2"
    )  # fmt: skip
    with (
        _running(a_node, stalling),
        _running(c_node, _serving(pki3, trio.c_ip)),
        _running(b_node, seeding) as b,
    ):
        model = _model(b)
        [seeded] = _events(b, "seeded")
        [dropped] = _events(b, "seed peer dropped")

    pa, pc = f"{trio.a_ip}:{PORT}", f"{trio.c_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {pc}")
    assert model.fingerprint.digest == _model_digest(b_node)  # verified shard by shard
    assert (dropped["peer"], dropped["result"], dropped["why"]) == (
        pa,
        "stalled",
        "stalled: a data connection received 0 bytes in 2 s, less than 65536 "
        "(--seed-stall-timeout)",
    )
    assert (seeded["pieces"], seeded["dropped"]) == ({pc: 2}, {pa: "stalled"})
    assert _events(b, SEED_FAILED) == []


@netns_only
def test_an_idle_connection_steals_from_a_slow_peer_all_but_its_last_piece(
    room: Path, trio: Trio, pki3: Pki
) -> None:
    a_node, b_node, c_node = _three(room, trio, big=True)
    # One connection per peer; eight 1 MiB pieces, A dealt the even ones (0, 2, 4, 6 MiB),
    # C the odd. A answers BeginSeed and then sends nothing (1 byte/s); C, done with its
    # own, steals from the far end of A's queue while A keeps one: pieces 6, then 4, never
    # 2. Once B logged piece 4 from C, A is killed: its first and last go to C.
    stalling = _serving(pki3, trio.a_ip, "--seed-max-rate", "1")
    seeding = _seeding(pki3, trio, "--seed-streams", "1", "--log-level", "debug")
    pc = f"{trio.c_ip}:{PORT}"
    with (
        _running(a_node, stalling) as a,
        _running(c_node, _serving(pki3, trio.c_ip)),
        _running(b_node, seeding, wait=False) as b,
    ):
        deadline = time.monotonic() + 60
        while not any(e["peer"] == pc and e["offset"] == 4 << 20 for e in _pieces(b)):
            assert b.proc.poll() is None and time.monotonic() < deadline, b.log()
            time.sleep(0.05)
        before = [(e["peer"], e["offset"]) for e in _pieces(b)]
        a.kill()
        b.wait_ready(models=1)
        model = _model(b)
        [seeded] = _events(b, "seeded")
        after = [(e["peer"], e["offset"]) for e in _pieces(b)]

    mib = 1 << 20
    pa = f"{trio.a_ip}:{PORT}"
    assert before == [(pc, 1 * mib), (pc, 3 * mib), (pc, 5 * mib), (pc, 7 * mib),
                      (pc, 6 * mib), (pc, 4 * mib)]  # fmt: skip
    assert sorted(after[len(before) :]) == [(pc, 0), (pc, 2 * mib)]
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {pc}")
    assert model.fingerprint.digest == _model_digest(b_node)
    assert (seeded["pieces"], seeded["dropped"]) == ({pc: 8}, {pa: "transfer"})
    assert _events(b, SEED_FAILED) == []


def _pieces(b: Daemon) -> list[dict[str, object]]:
    return _events(b, "seed piece")
