"""Seeding (issue 30): a daemon in network namespace B fills a model from the daemon in
namespace A over a veth pair, verified by content (docs/seeding.md).

The namespaces, the veth pair and the addresses are made by the test as root and removed
after it, failed or not; without root or the ``ip`` command (iproute2: ``make seed-deps``)
the namespace tests are skipped, saying so. Daemons run in their namespace through
``ip netns exec`` (which execs them: the same pid); the worker in B too. Each daemon has a
hash cache of its own, and B a copy of the checkpoint of its own.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.security_support import SYSTEM_PATHS, Pki, make_pki
from weightcache.core.errors import PermissionDeniedError, UnauthenticatedError
from weightcache.testing.checkpoints import make_checkpoints, wait_until_settled
from weightcache.testing.daemon import Daemon, list_models, short_tempdir, socket_in
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.authz import Policy, refusal

IP = shutil.which("ip", path=SYSTEM_PATHS)
SEED_FAILED = "seed failed: loading from the checkpoint's files"
PORT = 7443
_SKIP = (
    "needs root (ip netns add)"
    if os.geteuid() != 0
    else "needs the ip command (iproute2: make seed-deps)"
    if IP is None
    else None
)
netns_only = pytest.mark.skipif(_SKIP is not None, reason=f"seeding between namespaces {_SKIP}")


# -- the authorization rule (no namespace needed) ----------------------------------------

SEED_METHOD = "/weightcache.v1.WeightCacheService/BeginSeed"


def test_seeding_is_off_by_default_even_on_the_unix_socket() -> None:
    error = refusal(SEED_METHOD, Policy(mutual_tls=True), "unix:/run/wc/cpu.sock", set())

    assert isinstance(error, PermissionDeniedError)
    assert error.detail == (
        "BeginSeed refused: seeding is off on this daemon (started without --allow-seeding)"
    )
    assert error.metadata == {"method": "BeginSeed"}


def test_seeding_allowed_needs_an_authenticated_peer() -> None:
    policy = Policy(mutual_tls=True, subjects=frozenset({"node-b"}), allow_seeding=True)

    assert refusal(SEED_METHOD, policy, "unix:/run/wc/cpu.sock", set()) is None
    assert refusal(SEED_METHOD, policy, "ipv4:10.0.0.2:5000", {"node-b"}) is None
    stranger = refusal(SEED_METHOD, policy, "ipv4:10.0.0.2:5000", {"node-z"})
    anonymous = refusal(SEED_METHOD, policy, "ipv4:10.0.0.2:5000", set())
    assert isinstance(stranger, PermissionDeniedError)
    assert isinstance(anonymous, UnauthenticatedError)


# -- two namespaces ------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """Two network namespaces joined by a veth pair: A at ``a_ip``, B at ``b_ip``."""

    ns_a: str
    ns_b: str
    a_ip: str
    b_ip: str


def _ip(*args: str) -> None:
    assert IP is not None
    done = subprocess.run([IP, *args], capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


@pytest.fixture
def link() -> Iterator[Link]:
    """Namespaces ``wcsa-<hex>``, ``wcsb-<hex>`` and a veth pair, removed after."""
    tag = uuid.uuid4().hex[:6]
    net = int(tag[:2], 16)
    made = Link(f"wcsa-{tag}", f"wcsb-{tag}", f"10.231.{net}.1", f"10.231.{net}.2")
    created: list[str] = []
    try:
        for ns in (made.ns_a, made.ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", f"wcsa{tag}", "type", "veth", "peer", "name", f"wcsb{tag}")
        for ns, dev, address in (
            (made.ns_a, f"wcsa{tag}", made.a_ip),
            (made.ns_b, f"wcsb{tag}", made.b_ip),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        # Deleting a namespace deletes the veth end in it, and with it the pair.
        for ns in created:
            _ip("netns", "del", ns)
        with contextlib.suppress(AssertionError):
            _ip("link", "del", f"wcsa{tag}")  # only if it never moved into a namespace


@dataclass
class Node:
    """What the test holds of one namespace: a folder, its hash cache, its checkpoint."""

    ns: str
    folder: Path
    model: Path


@pytest.fixture
def room() -> Iterator[Path]:
    """A private temporary folder, removed after."""
    folder = short_tempdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _checkpoint(root: Path, big: bool, per_shard: int = 4) -> Path:
    """A sharded checkpoint: the harness's small one, or (``big``) two shards of
    ``per_shard`` float32 tensors of 1 MiB."""
    if not big:
        return make_checkpoints(root / "ck").sharded
    folder = root / "big"
    folder.mkdir()
    gen = torch.Generator().manual_seed(30)
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {
            f"layers.{shard}.{i}.weight": torch.randn(256, 1024, generator=gen)
            for i in range(per_shard)
        }
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    wait_until_settled(folder)
    return folder


@pytest.fixture
def pki(room: Path, link: Link) -> Pki:
    """A CA, a server certificate for A's address, client certificates (B's: ``client``)."""
    return make_pki(room / "pki", [link.a_ip])


def _nodes(room: Path, link: Link, big: bool = False, per_shard: int = 4) -> tuple[Node, Node]:
    a, b = _copies(room, _checkpoint(room, big, per_shard), [link.ns_a, link.ns_b])
    return a, b


def _copies(room: Path, source: Path, namespaces: list[str]) -> list[Node]:
    """A node per namespace (folders ``a``, ``b``, ...), each with its own copy of
    ``source``."""
    nodes = []
    for ns, name in zip(namespaces, "abc", strict=False):
        folder = room / name
        folder.mkdir()
        model = folder / source.name
        shutil.copytree(source, model)
        wait_until_settled(model)
        nodes.append(Node(ns, folder, model))
    return nodes


def _start(node: Node, args: list[str]) -> Daemon:
    assert IP is not None
    return Daemon(
        socket_in(node.folder, "d"),
        [str(node.model), "--log-format", "json", *args],
        node.folder / "daemon.log",
        wrap=[IP, "netns", "exec", node.ns],
        env={"WEIGHTCACHE_HASH_CACHE": str(node.folder / "hashes")},
    )


def _serving_args(pki: Pki, link: Link, *extra: str) -> list[str]:
    return [
        "--listen",
        f"{link.a_ip}:{PORT}",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        *extra,
    ]


def _seeding_args(pki: Pki, link: Link) -> list[str]:
    return [
        "--seed-from",
        f"{link.a_ip}:{PORT}",
        "--peer-tls-cert",
        str(pki.client_cert),
        "--peer-tls-key",
        str(pki.client_key),
        "--peer-tls-ca",
        str(pki.ca),
    ]


def _segments(daemon: Daemon) -> list[str]:
    """The /dev/shm segments of this daemon process (its pid is in their names)."""
    return sorted(glob.glob(f"/dev/shm/weightcache-*-{daemon.pid}-*"))


@contextlib.contextmanager
def _running(node: Node, args: list[str], *, wait: bool = True) -> Iterator[Daemon]:
    """A daemon in ``node``'s namespace, stopped after; its segments must all be gone
    (a SIGKILLed one's are removed here: the test made them)."""
    daemon = _start(node, args)
    try:
        if wait:
            daemon.wait_ready(models=1)
        yield daemon
    finally:
        left = _segments(daemon)
        if daemon.proc.poll() is None:
            daemon.stop_and_check()
            assert _segments(daemon) == [], daemon.log()
        else:
            for path in left:  # SIGKILLed by the test: nothing removed them
                os.unlink(path)


def _events(daemon: Daemon, event: str) -> list[dict[str, object]]:
    lines = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                lines.append(record)
    return lines


def _worker_in(node: Node, daemon: Daemon) -> dict[str, object]:
    """Load B's own copy through B's daemon from a process in B's namespace; compare it
    bitwise with safetensors reading the same files."""
    assert IP is not None
    script = (
        "import json, sys, weightcache\n"
        "from safetensors.torch import load_file\n"
        "from weightcache.core.checkpoint import open_checkpoint\n"
        "from weightcache.testing.checkpoints import assert_bitwise_equal\n"
        "path, socket = sys.argv[1:3]\n"
        "weights = weightcache.load(path, socket=socket, fallback=False)\n"
        "expected = {}\n"
        "for shard in open_checkpoint(path).shards:\n"
        "    expected.update(load_file(str(shard.path)))\n"
        "assert_bitwise_equal(weights.tensors, expected)\n"
        "print(json.dumps({'source': weights.source, 'tensors': len(weights.tensors)}))\n"
        "weights.close()\n"
    )
    done = subprocess.run(
        [
            IP,
            "netns",
            "exec",
            node.ns,
            sys.executable,
            "-c",
            script,
            str(node.model),
            daemon.socket,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def _model(daemon: Daemon) -> pb.Model:
    [model] = list_models(daemon.socket)
    return model


@netns_only
def test_seeds_a_sharded_checkpoint_from_the_peer(room: Path, link: Link, pki: Pki) -> None:
    a_node, b_node = _nodes(room, link)
    serving = _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding")
    seeding = [*_seeding_args(pki, link), "--metrics-listen", f"127.0.0.1:{METRICS_PORT}"]
    with _running(a_node, serving) as a, _running(b_node, seeding) as b:
        model = _model(b)
        [seeded] = _events(b, "seeded")
        metrics = _seed_metrics(b_node)
        ls = subprocess.run(
            [sys.executable, "-m", "weightcache_service.cli", "ls", "--socket", b.socket],
            capture_output=True,
            text=True,
            check=True,
        )
        worker = _worker_in(b_node, b)
        leases_on_a = list_models(a.socket)[0].lease_count

    peer = f"{link.a_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {peer}")
    assert model.fingerprint.digest == _model_digest(a_node)
    assert (seeded["peer"], seeded["bytes"], seeded["files_confirmed"], seeded["plane"]) == (
        peer,
        model.size_bytes,
        False,
        "tcp",  # the sendfile data plane, offered by default (issue 40)
    )
    header, row = ls.stdout.splitlines()[:2]
    assert header.split()[-1] == "SOURCE"
    assert row.endswith(f"peer {peer}")
    assert worker == {"source": "cache", "tensors": 9}
    assert leases_on_a == 0  # EndSeed released the transfer lease
    assert metrics["seeded"] == 1.0
    assert metrics["bytes"] == float(model.size_bytes)
    assert metrics["seconds"] > 0


METRICS_PORT = 9464


def _seed_metrics(node: Node) -> dict[str, float]:
    """The seed metrics of the daemon of ``node``, scraped from inside its namespace:
    ``weightcache_seeds_total`` by result, ``bytes`` and ``seconds``."""
    assert IP is not None
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    script = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    done = subprocess.run(
        [IP, "netns", "exec", node.ns, sys.executable, "-c", script],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    found: dict[str, float] = {}
    for line in done.stdout.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith('weightcache_seeds_total{result="'):
            found[name.split('"')[1]] = float(value)
        elif name == "weightcache_seeded_bytes_total":
            found["bytes"] = float(value)
        elif name == "weightcache_seed_seconds_total":
            found["seconds"] = float(value)
    return found


def _model_digest(node: Node) -> str:
    import weightcache

    checkpoint = weightcache.open_checkpoint(node.model)
    fp = weightcache.compute_fingerprint(checkpoint, weightcache.Recipe(), weightcache.Placement())
    return fp.digest


@netns_only
def test_a_lying_peer_is_refused_and_the_files_loaded(room: Path, link: Link, pki: Pki) -> None:
    a_node, b_node = _nodes(room, link)
    serving = _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding")
    with _running(a_node, serving) as a:
        [segment] = _segments(a)
        with open(segment, "r+b") as fh:  # the first tensor's first byte
            first = fh.read(1)
            fh.seek(0)
            fh.write(bytes([first[0] ^ 0xFF]))
        seeding = [*_seeding_args(pki, link), "--metrics-listen", f"127.0.0.1:{METRICS_PORT}"]
        with _running(b_node, seeding) as b:
            model = _model(b)
            [failed] = _events(b, SEED_FAILED)
            worker = _worker_in(b_node, b)
            metrics = _seed_metrics(b_node)

    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert model.fingerprint.digest == _model_digest(b_node)
    assert failed["result"] == "mismatch"
    why = str(failed["why"])
    assert why.startswith(
        "shard model-00001-of-00002.safetensors: the sha256 of the bytes received"
    )
    assert why.endswith("is not the peer's full-level digest " + _shard_sha(b_node)[:16] + "…")
    assert _events(b, "seeded") == []
    assert worker == {"source": "cache", "tensors": 9}
    assert (metrics["mismatch"], metrics["bytes"]) == (1.0, 0.0)
    assert "seeded" not in metrics


def _shard_sha(node: Node) -> str:
    import hashlib

    return hashlib.sha256(
        (node.model / "model-00001-of-00002.safetensors").read_bytes()
    ).hexdigest()


def _throttled_args(pki: Pki, link: Link) -> tuple[list[str], list[str]]:
    """A's and B's arguments for a seed slow enough to act during it: A serves each of
    B's 4 streams (or data connections) at 256 KiB/s, in 64 KiB chunks (8 MiB take
    about 8 s)."""
    serving = _serving_args(
        pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding", "--seed-max-rate", "262144"
    )
    return serving, [*_seeding_args(pki, link), "--seed-chunk-bytes", "65536"]


@netns_only
def test_a_peer_killed_mid_transfer_leaves_the_files_to_load(
    room: Path, link: Link, pki: Pki
) -> None:
    a_node, b_node = _nodes(room, link, big=True)
    # Throttled: time enough to see some bytes arrive and kill A midway.
    serving, seeding = _throttled_args(pki, link)
    seeding = [*seeding, "--seed-plane", "grpc"]  # the data plane's evict test covers tcp
    with _running(a_node, serving) as a, _running(b_node, seeding, wait=False) as b:
        _wait_for_progress(b)
        a.kill()
        b.wait_ready(models=1)
        model = _model(b)
        [failed] = _events(b, SEED_FAILED)

    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert model.fingerprint.digest == _model_digest(b_node)
    assert failed["result"] == "transfer"
    assert str(failed["why"]).startswith(f"from {link.a_ip}:{PORT}: ReadSeedData: UNAVAILABLE")


@netns_only
def test_weightcache_load_seeds_through_the_preload_rpc(room: Path, link: Link, pki: Pki) -> None:
    assert IP is not None
    a_node, b_node = _nodes(room, link)
    serving = _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding")
    peer = f"{link.a_ip}:{PORT}"
    tls = _seeding_args(pki, link)[2:]  # the --peer-tls-* files, without --seed-from
    remote = ["--allow-remote-preload", "--model-root", str(b_node.folder), *tls]
    with _running(a_node, serving):
        b = Daemon(
            socket_in(b_node.folder, "d"),
            ["--log-format", "json", *remote],
            b_node.folder / "daemon.log",
            wrap=[IP, "netns", "exec", b_node.ns],
            env={"WEIGHTCACHE_HASH_CACHE": str(b_node.folder / "hashes")},
        )
        try:
            b.wait_ready(models=0)
            load = subprocess.run(
                [sys.executable, "-m", "weightcache_service.cli", "load", str(b_node.model),
                 "--seed-from", peer, "--socket", b.socket],
                capture_output=True, text=True, check=False, timeout=120,
            )  # fmt: skip
            model = _model(b)
        finally:
            b.stop_and_check()
            assert _segments(b) == []

    assert load.returncode == 0, load.stderr
    assert load.stdout == f"sharded READY {model.progress.bytes_total} bytes\n"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {peer}")


def _wait_for_progress(b: Daemon) -> None:
    """Until B's model has some of its bytes, not all."""
    deadline = time.monotonic() + 60
    while True:
        held = list_models(b.socket) if os.path.exists(b.socket) else []
        if held and 0 < held[0].progress.bytes_done < held[0].progress.bytes_total:
            return
        assert not held or held[0].state == pb.MODEL_STATE_LOADING, b.log()
        assert time.monotonic() < deadline, b.log()
        time.sleep(0.05)


@netns_only
@pytest.mark.parametrize(
    ("plane", "why"),
    [
        (
            "grpc",
            "ReadSeedData: NOT_FOUND: the transfer lease ended (released, expired, or "
            "revoked by an evict or a drain)",
        ),
        ("tcp", "data connection: the peer closed the data connection "),
    ],
)
def test_an_evict_on_the_peer_ends_the_transfer_at_once(
    room: Path, link: Link, pki: Pki, plane: str, why: str
) -> None:
    a_node, b_node = _nodes(room, link, big=True)
    serving, seeding = _throttled_args(pki, link)
    seeding = [*seeding, "--seed-plane", plane]
    with _running(a_node, serving) as a, _running(b_node, seeding, wait=False) as b:
        _wait_for_progress(b)
        with grpc.insecure_channel(f"unix:{a.socket}") as channel:
            stub = pb_grpc.WeightCacheServiceStub(channel)
            # Not held back by the transfer lease (issue 37): no LEASES_ACTIVE, no force.
            evicted = stub.Evict(pb.EvictRequest(name="big"), timeout=10)
        b.wait_ready(models=1)
        model = _model(b)
        [failed] = _events(b, SEED_FAILED)
        held_by_a = list_models(a.socket)

    assert evicted.model.name == "big"
    assert held_by_a == []
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert failed["result"] == "transfer"
    assert str(failed["why"]).startswith(f"from {link.a_ip}:{PORT}: {why}")


@netns_only
@pytest.mark.parametrize(
    ("case", "extra", "why"),
    [
        (
            "no mutual TLS",
            ["--allow-seeding"],
            "BeginSeed needs an authenticated peer: the Unix socket, or TCP with a client "
            "certificate that the daemon's --tls-client-ca signed",
        ),
        (
            "no allow rule",
            ["--tls-client-ca", "CA"],
            "BeginSeed refused: seeding is off on this daemon (started without --allow-seeding)",
        ),
    ],
)
def test_a_peer_that_does_not_allow_it_is_refused(
    room: Path, link: Link, pki: Pki, *, case: str, extra: list[str], why: str
) -> None:
    a_node, b_node = _nodes(room, link)
    extra = [str(pki.ca) if arg == "CA" else arg for arg in extra]
    serving = _serving_args(pki, link, *extra)
    with _running(a_node, serving), _running(b_node, _seeding_args(pki, link)) as b:
        model = _model(b)
        [failed] = _events(b, SEED_FAILED)

    code = "UNAUTHENTICATED" if case == "no mutual TLS" else "PERMISSION_DENIED"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert failed["result"] == "refused"
    assert failed["why"] == f"BeginSeed {link.a_ip}:{PORT}: {code}: {why}"


# -- the data plane's wire format (no namespace needed) ----------------------------------


@pytest.mark.parametrize(("offset", "data"), [(0, b""), (0, b"abc"), (300, bytes(range(256)) * 3)])
def test_raw_responses_are_the_message_on_the_wire(offset: int, data: bytes) -> None:
    from weightcache_service.arena import SharedMemoryArena, Slot, align
    from weightcache_service.dataplane import parse_response
    from weightcache_service.seed_serve import response_bytes

    arena = SharedMemoryArena(max(align(offset + len(data)), 256), "weightcache-seedtest-")
    try:
        slot = Slot("t", "U8", (len(data),), offset, len(data))

        def fill(out: memoryview) -> None:
            out[:] = data

        arena.read_into(slot, fill)
        raw = response_bytes(arena, offset, len(data))
    finally:
        arena.close()
    message = pb.ReadSeedDataResponse.FromString(raw)
    at, view = parse_response(message.SerializeToString())

    assert (message.offset, message.data) == (offset, data)
    assert (at, bytes(view)) == (offset, data)
    assert parse_response(raw)[0] == offset


# -- what spares a seed page faults (no namespace needed) --------------------------------

_POPULATE = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (5, 14)


@pytest.mark.skipif(not _POPULATE, reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_populated_arena_is_written_without_page_faults() -> None:
    import resource

    from weightcache_service.arena import SharedMemoryArena, Slot

    size = 64 << 20  # 16384 pages of 4 KiB
    data = bytes(range(256)) * (size // 256)
    arena = SharedMemoryArena(size, "weightcache-seedtest-")
    try:
        assert arena.populate() is True
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def fill(out: memoryview) -> None:
            out[:] = data

        arena.read_into(Slot("t", "U8", (size,), 0, size), fill)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        got: list[bytes] = []
        arena.read_into(Slot("t", "U8", (size,), 0, size), lambda view: got.append(bytes(view)))
    finally:
        arena.close()
    assert got == [data]
    assert faults < 1024  # a fault per page would be 16384 (other threads fault a few)


# -- a peer that stalls (issue 37, item 3) --------------------------------------------------


def _stalling_args(pki: Pki, link: Link) -> tuple[list[str], list[str]]:
    """A serves each stream at 1 byte/s: its first 64 KiB chunk is due in 18 hours, so A
    answers BeginSeed and then sends nothing. B asks 64 KiB chunks."""
    serving = _serving_args(
        pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding", "--seed-max-rate", "1"
    )
    return serving, [*_seeding_args(pki, link), "--seed-chunk-bytes", "65536"]


def _wait_for_event(daemon: Daemon, event: str) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while not (found := _events(daemon, event)):
        assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    return found[0]


@netns_only
@pytest.mark.parametrize(
    ("plane", "stream"),
    [("grpc", "a ReadSeedData stream"), ("tcp", "a data connection")],
)
def test_a_stalled_peer_is_abandoned_for_the_files_within_the_bound(
    room: Path, link: Link, pki: Pki, plane: str, stream: str
) -> None:
    a_node, b_node = _nodes(room, link)
    serving, seeding = _stalling_args(pki, link)
    seeding = [*seeding, "--seed-stall-timeout", "2", "--seed-plane", plane]
    with _running(a_node, serving) as a, _running(b_node, seeding, wait=False) as b:
        begun = _wait_for_event(a, "seed begun")
        started = time.monotonic()
        b.wait_ready(models=1)
        waited = time.monotonic() - started
        model = _model(b)
        [failed] = _events(b, SEED_FAILED)
        leases_on_a = list_models(a.socket)[0].lease_count

    assert begun["model"] == "sharded"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert model.fingerprint.digest == _model_digest(b_node)
    assert failed["result"] == "stalled"
    assert failed["why"] == (
        f"from {link.a_ip}:{PORT}: stalled: {stream} received 0 bytes in 2 s, "
        "less than 65536 (--seed-stall-timeout)"
    )
    assert waited < 2 + 20  # the bound, and the load from the files (unbounded before)
    assert leases_on_a == 0  # B's EndSeed released the transfer lease


@netns_only
def test_sigterm_stops_a_daemon_whose_seed_stalls_within_the_drain_timeout(
    room: Path, link: Link, pki: Pki
) -> None:
    a_node, b_node = _nodes(room, link)
    serving, seeding = _stalling_args(pki, link)
    # The stall bound (default 30 s) is longer than the drain timeout: SIGTERM must not
    # wait for it.
    with (
        _running(a_node, serving) as a,
        _running(b_node, [*seeding, "--drain-timeout", "3"], wait=False) as b,
    ):
        _wait_for_event(a, "seed begun")
        assert list_models(b.socket)[0].state == pb.MODEL_STATE_LOADING
        at = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        rc = b.proc.wait(timeout=45)
        took = time.monotonic() - at
        left = b.leftovers()

    assert rc == 0, b.log()
    assert took < 3 + 5, b.log()  # the drain timeout and the shutdown (40 s and more before)
    assert left == []


class _TricklingPeer:
    """A real gRPC server on a Unix socket (a test peer, not our daemon) whose ReadSeedData
    answers every ``every`` seconds with ``data`` (empty chunks, or one byte) for as long
    as the call lives: progress, but never a whole chunk."""

    def __init__(self, folder: Path, data: bytes, every: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.socket = str(folder / "peer.sock")
        self.server = grpc.server(ThreadPoolExecutor(max_workers=8))

        def read(request: pb.ReadSeedDataRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
            offset = request.offset
            while context.is_active():
                yield pb.ReadSeedDataResponse(offset=offset, data=data).SerializeToString()
                offset += len(data)
                time.sleep(every)

        handler = grpc.unary_stream_rpc_method_handler(
            read, request_deserializer=pb.ReadSeedDataRequest.FromString
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(
                "weightcache.v1.WeightCacheService", {"ReadSeedData": handler}
            ),)
        )  # fmt: skip
        self.server.add_insecure_port(f"unix:{self.socket}")
        self.server.start()

    def close(self) -> None:
        self.server.stop(0).wait()


@pytest.mark.parametrize(("case", "data"), [("empty chunks", b""), ("a byte at a time", b"x")])
def test_a_trickling_stream_is_abandoned_as_stalled(room: Path, case: str, data: bytes) -> None:
    import threading

    from weightcache_service.dataplane import GrpcStreamPlane, StalledError

    peer = _TricklingPeer(room, data, every=0.05)
    outcome: list[BaseException | None] = []
    written: list[int] = []

    def pull() -> None:
        with grpc.insecure_channel(f"unix:{peer.socket}") as channel:
            plane = GrpcStreamPlane(channel, streams=2, chunk_bytes=65536, stall_timeout=1.0)
            try:
                plane.pull("lease", [(0, 1 << 20)], lambda _o, d: written.append(len(d)),
                           lambda: False)  # fmt: skip
                outcome.append(None)
            except BaseException as exc:  # the test asserts what it is
                outcome.append(exc)

    thread = threading.Thread(target=pull, daemon=True)
    started = time.monotonic()
    try:
        thread.start()
        thread.join(30)  # unbounded before the stall bound
        took = time.monotonic() - started
    finally:
        peer.close()
        thread.join(10)

    [error] = outcome
    assert isinstance(error, StalledError), error
    assert str(error).startswith("stalled: a ReadSeedData stream received ")
    assert str(error).endswith(" bytes in 1 s, less than 65536 (--seed-stall-timeout)")
    assert sum(written) < 65536 * 2
    assert took < 1 + 5


# -- whose transfer lease, and the bounds per peer (issue 37, items 4, 5, 8, 9) -------------


class _Peer:
    """A seeding peer in B's namespace (``tests/seed_peer.py``), with a client certificate."""

    def __init__(self, node: Node, link: Link, pki: Pki, cert: Path, key: Path) -> None:
        assert IP is not None
        self.proc = subprocess.Popen(
            [IP, "netns", "exec", node.ns, sys.executable, "-m", "tests.seed_peer",
             f"{link.a_ip}:{PORT}", str(pki.ca), str(cert), str(key), str(node.model)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip

    def __call__(self, op: str, **fields: object) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the peer process ended (exit {self.proc.poll()})"
        answer: dict[str, object] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@contextlib.contextmanager
def _peers(node: Node, link: Link, pki: Pki) -> Iterator[tuple[_Peer, _Peer]]:
    """Two peers: one with the ``client`` certificate, one with the ``stranger``'s (both
    signed by the CA: two identities the daemon allows)."""
    peers: list[_Peer] = []
    try:
        for cert, key in ((pki.client_cert, pki.client_key), (pki.stranger_cert, pki.stranger_key)):
            peers.append(_Peer(node, link, pki, cert, key))
        yield peers[0], peers[1]
    finally:
        for peer in peers:
            peer.close()


def _unix_leases(daemon: Daemon) -> dict[str, str]:
    """Every live lease of ``daemon`` (its Unix socket sees them all): id -> label."""
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        listed = stub.ListLeases(pb.ListLeasesRequest(), timeout=20)
    return {h.lease.lease_id: h.worker.label for h in listed.leases}


NOT_FOUND = {
    "code": "NOT_FOUND",
    "reason": "MODEL_NOT_FOUND",
    "metadata": {},
}


@netns_only
def test_seeding_rpcs_accept_only_the_callers_own_transfer_leases(
    room: Path, link: Link, pki: Pki
) -> None:
    from weightcache.testing.driver import Worker

    a_node, b_node = _nodes(room, link)
    serving = _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding")
    with _running(a_node, serving) as a, _peers(b_node, link, pki) as (peer, stranger):
        worker = Worker(room / "worker.log")
        try:
            loaded = worker.load(a_node.model, socket=a.socket, fallback=False)
            [worker_lease] = _unix_leases(a)
            listed_before = peer("list")
            read_through_worker = peer("read", lease_id=worker_lease, length=4096, chunk_bytes=0)
            ended_worker = peer("end", lease_id=worker_lease)
            own = str(peer("begin")["lease_id"])
            listed_own = peer("list")
            stranger_reads = stranger("read", lease_id=own, length=4096, chunk_bytes=0)
            stranger_ends = stranger("end", lease_id=own)
            stranger_lists = stranger("list")
            own_read = peer("read", lease_id=own, length=4096, chunk_bytes=0)
            live = _unix_leases(a)
            peer("end", lease_id=own)
            after_end = _unix_leases(a)
        finally:
            worker.close()

    assert loaded["ok"] is True and loaded["source"] == "cache"
    assert listed_before == {"leases": []}  # the worker's lease is not shown to a TCP peer
    assert read_through_worker == NOT_FOUND
    assert ended_worker == {}  # as for an ended lease: nothing told, nothing ended
    assert listed_own == {
        "leases": [{"lease_id": own, "model": "sharded", "label": "seed", "ttl": 30}]
    }
    assert stranger_reads == NOT_FOUND
    assert (stranger_ends, stranger_lists) == ({}, {"leases": []})
    assert own_read == {"bytes": 4096}
    assert live == {worker_lease: "", own: "seed"}  # neither was ended by another
    assert after_end == {worker_lease: ""}


def _rss_anon(pid: int) -> int:
    """The daemon's anonymous resident memory, in bytes (``RssAnon``, proc(5))."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@netns_only
def test_seeding_is_bounded_per_peer(room: Path, link: Link, pki: Pki) -> None:
    from weightcache_service.leases import MAX_TRANSFER_LEASES_PER_PEER
    from weightcache_service.seed_serve import MAX_STREAMS_PER_PEER

    a_node, b_node = _nodes(room, link, big=True)
    # 64 KiB/s per stream: a stream of the 8 MiB arena lasts 128 s, so the streams opened
    # are all still being served when the next one is asked for.
    serving = _serving_args(
        pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding", "--seed-max-rate", "65536"
    )
    with _running(a_node, serving) as a, _peers(b_node, link, pki) as (peer, stranger):
        begun = peer("begin", ttl=300)  # asks 300 s: clamped to MAX_SEED_TTL
        own, size = str(begun["lease_id"]), int(str(begun["arena_size"]))
        leases = peer("list")["leases"]
        assert isinstance(leases, list)
        [listed] = leases
        tiny = peer("read", lease_id=own, length=size, chunk_bytes=1)
        before = _rss_anon(a.pid)
        # 64 streams on one connection, each read for one 64 KiB chunk of 8 MiB, no more.
        opened = peer("open", lease_id=own, streams=64, length=size, chunk_bytes=65536)
        grown = _rss_anon(a.pid) - before
        peer("close")
        flood = [peer("begin") for _ in range(MAX_TRANSFER_LEASES_PER_PEER)]
        other = stranger("begin")
        with grpc.insecure_channel(f"unix:{a.socket}") as channel:
            stub = pb_grpc.WeightCacheServiceStub(channel)
            evicted = stub.Evict(pb.EvictRequest(name="big"), timeout=10)
        left = _unix_leases(a)
        held = list_models(a.socket)

    assert size == 8 << 20
    assert (listed["lease_id"], listed["ttl"]) == (own, 60)
    assert tiny == {
        "code": "INVALID_ARGUMENT",
        "reason": "INVALID_ARGUMENT",
        "metadata": {"field": "chunk_bytes"},
    }
    assert opened == {
        "opened": MAX_STREAMS_PER_PEER,
        "refused": ["RESOURCE_EXHAUSTED"] * (64 - MAX_STREAMS_PER_PEER),
    }
    assert grown < MAX_STREAMS_PER_PEER * size + (32 << 20)  # 500 MiB and more before
    assert all("lease_id" in answer for answer in flood[:-1])
    assert flood[-1] == {
        "code": "RESOURCE_EXHAUSTED",
        "reason": "RESOURCE_EXHAUSTED",
        "metadata": {"field": "transfer_leases"},
    }
    assert "lease_id" in other  # another peer is not locked out
    # A plain evict ends the transfer leases at once instead of waiting for them.
    assert (evicted.model.name, left, held) == ("big", {}, [])


# -- the sendfile data plane (issue 40) --------------------------------------------------


@netns_only
def test_a_data_connection_needs_a_fresh_secret_of_its_lease(
    room: Path, link: Link, pki: Pki
) -> None:
    import hashlib

    from weightcache_service.sendfile_serve import MAX_PENDING_PER_ADDRESS

    a_node, b_node = _nodes(room, link)
    serving = _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding")
    with _running(a_node, serving) as a:
        [segment] = _segments(a)
        with _peers(b_node, link, pki) as (peer, _stranger):
            begun = peer("begin", connections=3)
            port, size, secrets = begun["data_port"], begun["arena_size"], begun["secrets"]
            assert isinstance(secrets, list) and isinstance(size, int)
            whole = [[0, size]]
            first = peer("data", port=port, secret=secrets[0], ranges=whole)
            again = peer("data", port=port, secret=secrets[0], ranges=whole)
            wrong = peer("data", port=port, secret=os.urandom(32).hex(), ranges=whole)
            silent = peer("silent", port=port)  # closed after HELLO_TIMEOUT (5 s)
            # One address holds at most MAX_PENDING_PER_ADDRESS connections without a
            # hello: the one more is closed at once, the others after HELLO_TIMEOUT.
            crowd = peer("crowd", port=port, count=MAX_PENDING_PER_ADDRESS + 1)
            outside = peer("data", port=port, secret=secrets[1], ranges=[[0, size + 1]])
            peer("end", lease_id=begun["lease_id"])
            ended = peer("data", port=port, secret=secrets[2], ranges=whole)
            arena = Path(segment).read_bytes()[:size]
        refusals = [e["why"] for e in _events(a, "seed data connection refused")]
        [listening] = _events(a, "listening for seed data")
        with _running(b_node, _seeding_args(pki, link)) as b:  # a seed still works after
            model = _model(b)
            [seeded] = _events(b, "seeded")

    nothing = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    assert (listening["address"], listening["port"]) == (link.a_ip, port)
    assert len(secrets) == 3 and all(len(bytes.fromhex(s)) == 32 for s in secrets)
    assert first == {"bytes": size, "sha256": hashlib.sha256(arena).hexdigest()}
    assert again == wrong == outside == ended == nothing  # closed before any byte
    assert silent == {"bytes": 0}
    assert crowd == {"bytes": [0] * (MAX_PENDING_PER_ADDRESS + 1)}
    assert refusals == [
        "no valid secret",
        "no valid secret",
        "no hello in time",
        "too many pending",
        *["no hello in time"] * MAX_PENDING_PER_ADDRESS,
        f"the ranges asked pass the {size}-byte arena, or 2 times its size or 4096 ranges "
        "on one connection",
        "no valid secret",  # EndSeed dropped the lease's unused secrets
    ]
    assert (model.source, seeded["plane"]) == (f"peer {link.a_ip}:{PORT}", "tcp")


def test_the_data_port_on_ipv6s_unspecified_address_takes_ipv4_peers_as_grpc_does() -> None:
    # Review of issue 40: asyncio's start_server makes an IPv6 socket IPv6-only, while
    # gRPC's `--listen [::]:P` takes IPv4 peers too: their BeginSeed worked, their data
    # connection was refused. The data port is now dual-stack there, and an IPv4 peer's
    # address compares equal whichever way it arrives.
    import socket

    from weightcache_service.sendfile_serve import _listening_socket, peer_address, plain_address

    listener = _listening_socket("::", 0)
    assert listener is not None and _listening_socket("127.0.0.1", 0) is None
    listener.listen()
    with listener, socket.create_connection(("127.0.0.1", listener.getsockname()[1]), 5):
        accepted, (host, *_rest) = listener.accept()
        accepted.close()
    assert (host, plain_address(host)) == ("::ffff:127.0.0.1", "127.0.0.1")
    assert peer_address("ipv6:%5B::ffff:10.0.0.2%5D:5000") == "10.0.0.2"
    assert peer_address("ipv4:10.0.0.2:5000") == plain_address("10.0.0.2") == "10.0.0.2"
    assert plain_address("fd00::2") == "fd00::2"
