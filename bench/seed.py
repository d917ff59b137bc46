"""Seeding between two network namespaces (issue 30): seed time against bulk copy.

Run as root (it makes two network namespaces and a veth pair, removed at the end):

    .venv/bin/python bench/seed.py --gib 2 --rounds 2

For a model of ``--gib`` GiB in 8 shards, each in its own folder for A and B:

- **link**: the shard files sent from namespace A to B over the veth pair by a bulk copy
  at its fastest (``socket.sendfile`` in A, ``recv_into`` a buffer in B: the page cache to
  the wire and back, no TLS), with 1 and with 4 connections in parallel; also ``curl``
  from ``python -m http.server`` (one connection) as the plain "cp over HTTP" figure.
- **seed**: daemon B (``--seed-from A``, mutual TLS) loading the model from daemon A,
  for each ``--plans`` entry (``PLANE:STREAMSxCHUNK_MIB``: ``tcp``, the sendfile data
  plane, ``grpc``, ReadSeedData streams, or ``mooncake``, Mooncake's transfer engine
  between staging buffers, A then started with ``--seed-mooncake``): B's ``loaded``
  seconds (arena, transfer, sha256 of every shard, READY).
- **transfer alone** (issue 40): a process in B that calls BeginSeed on daemon A and
  pulls the whole arena over the sendfile data plane (``SendfilePlane``, ``--raw``
  connections) into a populated anonymous mapping: no hashing, no daemon B.
- **files**: daemon B loading the model from its own page-cached files, with its hash
  cache cold (it hashes every shard, as a first load does) and warm (copy only).

Prints a table; the goal is the seed at >= 0.8x of the link's bulk throughput.

With ``--two-peers RATE`` (issue 40, Build 2) it measures instead a seed from several
peers: three namespaces, daemons A and C warm (the model READY), each joined to B by a
veth pair of its own whose peer-side egress ``tc`` limits to RATE (a ``tbf`` qdisc, e.g.
``800mbit``), so that the links, not the CPUs, bound; then daemon B seeds the model from A
alone, from C alone, and from both (``--seed-from A,C``), ``--rounds`` times, and the
link (a bulk sendfile copy from A over its limited pair) for scale:

    .venv/bin/python bench/seed.py --two-peers 800mbit --gib 0.5 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.security_support import SYSTEM_PATHS, Pki, make_pki
from weightcache.testing.daemon import Daemon, short_tempdir, socket_in

IP = shutil.which("ip", path=SYSTEM_PATHS) or "ip"
TC = shutil.which("tc", path=SYSTEM_PATHS) or "tc"
PORT = 7443
BULK_PORT = 7444
HTTP_PORT = 7445
SHARDS = 8


def ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def namespaces() -> Iterator[tuple[str, str, str, str]]:
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, a_ip, b_ip = f"wcba-{tag}", f"wcbb-{tag}", "10.232.0.1", "10.232.0.2"
    made = []
    try:
        for ns in (ns_a, ns_b):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", f"wcba{tag}", "type", "veth", "peer", "name", f"wcbb{tag}")
        for ns, dev, addr in ((ns_a, f"wcba{tag}", a_ip), (ns_b, f"wcbb{tag}", b_ip)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, a_ip, b_ip
    finally:
        for ns in made:
            ip("netns", "del", ns)


def write_model(folder: Path, gib: float) -> int:
    """``SHARDS`` shards of random U8 tensors, ``gib`` GiB in all; returns the bytes."""
    folder.mkdir(parents=True)
    per_shard = int(gib * (1 << 30)) // SHARDS
    weight_map = {}
    gen = torch.Generator().manual_seed(30)
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {
            f"layers.{shard}.{i}.weight": torch.randint(
                0, 256, (per_shard // 4,), dtype=torch.uint8, generator=gen
            )
            for i in range(4)
        }
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


_SENDER = """
import os, socket, sys
files = sys.argv[3:]
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    want = conn.recv(4096).decode().strip()
    if want == "quit":
        break
    with conn, open(want, "rb") as fh:
        conn.sendfile(fh)
"""

_RECEIVER = """
import socket, sys, time, threading
host, port, files = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
parallel = int(sys.argv[3])
total = [0]
lock = threading.Lock()
def pull(names):
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    for name in names:
        with socket.create_connection((host, port)) as s:
            s.sendall(name.encode() + b"\\n")
            while True:
                n = s.recv_into(view)
                if not n:
                    break
                with lock:
                    total[0] += n
start = time.perf_counter()
threads = [threading.Thread(target=pull, args=(files[i::parallel],)) for i in range(parallel)]
for t in threads: t.start()
for t in threads: t.join()
print(total[0], time.perf_counter() - start)
"""


def print_rates(
    results: dict[str, list[float]], size: int, baseline: float, ratio: str, width: int = 44
) -> None:
    """One line per path of ``results`` (its seconds per run): the median, the GB/s of
    ``size`` bytes, ``baseline`` seconds over the median (column ``ratio``), every run."""
    column = max(6, len(ratio) + 1)
    print(f"{'path':{width}} {'median s':>9} {'GB/s':>6} {ratio:>{column}}   runs")
    for key, values in results.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:.2f}" for v in values)
        rate = f"{size / med / 1e9:6.2f} {baseline / med:{column}.2f}"
        print(f"{key:{width}} {med:9.2f} {rate}   {runs}")


def bulk_link(ns_a: str, ns_b: str, a_ip: str, files: list[Path], parallel: int) -> float:
    """Seconds to move ``files`` from A to B by sendfile/recv_into over ``parallel``
    connections."""
    sender = subprocess.Popen(
        [IP, "netns", "exec", ns_a, sys.executable, "-c", _SENDER, a_ip, str(BULK_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None
        assert sender.stdout.readline().strip() == "ready"
        names = [str(f) for f in files]
        done = subprocess.run(
            [IP, "netns", "exec", ns_b, sys.executable, "-c", _RECEIVER, a_ip, str(BULK_PORT),
             str(parallel), *names],
            capture_output=True, text=True, check=True, timeout=600,
        )  # fmt: skip
        nbytes, seconds = done.stdout.split()
        assert int(nbytes) == sum(f.stat().st_size for f in files)
        return float(seconds)
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(
                [IP, "netns", "exec", ns_b, sys.executable, "-c",
                 "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])))"
                 ".sendall(b'quit')", a_ip, str(BULK_PORT)],
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
        sender.wait(30)


def curl_link(ns_a: str, ns_b: str, a_ip: str, folder: Path, files: list[Path]) -> float:
    """Seconds for curl in B to fetch ``files`` one after another from http.server in A."""
    server = subprocess.Popen(
        [IP, "netns", "exec", ns_a, sys.executable, "-m", "http.server", str(HTTP_PORT),
         "--bind", a_ip, "--directory", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        urls = [f"http://{a_ip}:{HTTP_PORT}/{f.name}" for f in files]
        start = time.perf_counter()
        for url in urls:
            subprocess.run(
                [IP, "netns", "exec", ns_b, "curl", "-sf", "-o", "/dev/null", url],
                check=True, timeout=600,
            )  # fmt: skip
        return time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(30)


_RAW = """
import json, mmap, sys, time
from pathlib import Path
import grpc
from tests.seed_peer import _components
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.sendfile_plane import SendfilePlane
target, ca, cert, key, model, connections = sys.argv[1:7]
creds = grpc.ssl_channel_credentials(
    Path(ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes()
)
with grpc.secure_channel(target, creds) as channel:
    stub = pb_grpc.WeightCacheServiceStub(channel)
    begun = stub.BeginSeed(pb.BeginSeedRequest(
        components=_components(model), data_connections=int(connections)), timeout=30)
    size = begun.arena_size
    buf = mmap.mmap(-1, size)
    buf.madvise(23)  # MADV_POPULATE_WRITE, as the daemon's arena (no fault per page)
    view = memoryview(buf)
    plane = SendfilePlane(target.rpartition(":")[0], begun.data_port,
                          list(begun.data_secrets), lambda o, n, fill: fill(view[o:o + n]))
    start = time.monotonic()
    plane.pull(begun.lease_id, [(0, size)], lambda _o, _d: None, lambda: False)
    seconds = time.monotonic() - start
    stub.EndSeed(pb.EndSeedRequest(lease_id=begun.lease_id), timeout=10)
    view.release()
print(json.dumps({"seconds": seconds, "bytes": size}))
"""


def raw_plane(ns_b: str, target: str, client: list[str], model: Path, connections: int) -> float:
    """Seconds to pull daemon A's whole arena over the sendfile plane from namespace B,
    with ``connections`` connections, into a populated mapping (no hashing)."""
    done = subprocess.run(
        [IP, "netns", "exec", ns_b, sys.executable, "-c", _RAW, target, *client, str(model),
         str(connections)],
        capture_output=True, text=True, check=True, timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    return float(json.loads(done.stdout.splitlines()[-1])["seconds"])


def _event(daemon: Daemon, event: str) -> dict[str, object]:
    for line in daemon.log().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                return record
    raise AssertionError(f"no {event!r} in:\n{daemon.log()[-3000:]}")


def run_daemon(
    ns: str, folder: Path, name: str, model: Path, args: list[str], *, hashes: Path
) -> Daemon:
    daemon = Daemon(
        socket_in(folder, name),
        [str(model), "--log-format", "json", *args],
        folder / f"{name}.log",
        wrap=[IP, "netns", "exec", ns],
        env={"WEIGHTCACHE_HASH_CACHE": str(hashes)},
    )
    daemon.wait_ready(timeout=900, models=1)
    return daemon


@contextlib.contextmanager
def three_namespaces(rate: str) -> Iterator[tuple[str, str, str, str, str]]:
    """Namespaces A, B, C; a veth pair A-B and one C-B, each peer side's egress limited
    to ``rate`` by a ``tbf`` qdisc. Yields ``(ns_a, ns_b, ns_c, a_ip, c_ip)``."""
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, ns_c = f"wcba-{tag}", f"wcbb-{tag}", f"wcbc-{tag}"
    a_ip, c_ip = "10.234.1.1", "10.234.2.1"
    made = []
    try:
        for ns in (ns_a, ns_b, ns_c):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for ns, side, net in ((ns_a, "a", 1), (ns_c, "c", 2)):
            there, here = f"wcb{side}{tag}", f"wcbb{side}{tag}"
            ip("link", "add", there, "type", "veth", "peer", "name", here)
            for where, dev, addr in (
                (ns, there, f"10.234.{net}.1"),
                (ns_b, here, f"10.234.{net}.2"),
            ):
                ip("link", "set", dev, "netns", where)
                ip("-n", where, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", where, "link", "set", dev, "up")
            subprocess.run(
                [IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", there, "root", "tbf",
                 "rate", rate, "burst", "1mb", "latency", "100ms"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        yield ns_a, ns_b, ns_c, a_ip, c_ip
    finally:
        for ns in made:
            ip("netns", "del", ns)


def two_peers(args: argparse.Namespace) -> int:
    """The ``--two-peers`` bench (module docstring)."""
    root = short_tempdir()
    try:
        with three_namespaces(args.two_peers) as (ns_a, ns_b, ns_c, a_ip, c_ip):
            size = write_model(root / "a" / "model", args.gib)
            for name in ("b", "c"):
                shutil.copytree(root / "a" / "model", root / name / "model")
            files = sorted((root / "a" / "model").glob("*.safetensors"))
            pki: Pki = make_pki(root / "pki", [a_ip, c_ip])
            serving = {
                name: run_daemon(
                    ns, root / name, name, root / name / "model",
                    ["--listen", f"{addr}:{PORT}", "--tls-cert", str(pki.server_cert),
                     "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
                     "--allow-seeding"],
                    hashes=root / name / "hashes",
                )
                for name, ns, addr in (("a", ns_a, a_ip), ("c", ns_c, c_ip))
            }  # fmt: skip
            tls = [
                "--peer-tls-cert", str(pki.client_cert), "--peer-tls-key", str(pki.client_key),
                "--peer-tls-ca", str(pki.ca),
            ]  # fmt: skip
            peers = {
                "A": f"{a_ip}:{PORT}",
                "C": f"{c_ip}:{PORT}",
                "A,C": f"{a_ip}:{PORT},{c_ip}:{PORT}",
            }
            results: dict[str, list[float]] = {}
            try:
                for r in range(args.rounds):
                    results.setdefault("link: sendfile from A, 4 connections", []).append(
                        bulk_link(ns_a, ns_b, a_ip, files, 4)
                    )
                    for label, seed_from in peers.items():
                        b = run_daemon(
                            ns_b, root / "b", f"s{r}-{label.replace(',', '')}",
                            root / "b" / "model", ["--seed-from", seed_from, *tls],
                            hashes=root / "b" / f"hashes-{r}-{label}",
                        )  # fmt: skip
                        try:
                            seeded = _event(b, "seeded")
                            loaded = _event(b, "loaded")
                        finally:
                            b.stop_and_check()
                        print(f"seed from {label}:", seeded.get("pieces"), flush=True)
                        results.setdefault(f"seed from {label}", []).append(
                            float(str(loaded["seconds"]))
                        )
            finally:
                for daemon in serving.values():
                    daemon.stop_and_check()
        print(
            f"model: {size / (1 << 30):.2f} GiB in {SHARDS} shards; {os.cpu_count()} CPUs; "
            f"each peer's link limited to {args.two_peers} (tbf)"
        )
        print_rates(results, size, statistics.median(results["seed from A"]), "x A", 40)
        print("x A: the seed from A alone's median seconds over this path's")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--plans",
        default="tcp:2x4,tcp:4x4,grpc:4x4",
        help="seed plans: PLANE:STREAMSxCHUNK_MIB (PLANE tcp, grpc or mooncake), comma-separated",
    )
    parser.add_argument(
        "--raw", default="1,4", help="connections of the transfer-alone runs, comma-separated"
    )
    parser.add_argument(
        "--two-peers",
        default=None,
        metavar="RATE",
        help="instead: seed from one peer and from two, each link limited to RATE (tc tbf)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/seed.py: run as root (it makes network namespaces)", file=sys.stderr)
        return 2
    if args.two_peers:
        return two_peers(args)
    root = short_tempdir()
    try:
        with namespaces() as (ns_a, ns_b, a_ip, _b_ip):
            size = write_model(root / "a" / "model", args.gib)
            shutil.copytree(root / "a" / "model", root / "b" / "model")
            files = sorted((root / "a" / "model").glob("*.safetensors"))
            b_model = root / "b" / "model"
            for f in [*files, *b_model.glob("*")]:  # page cache warm on both sides
                with open(f, "rb") as fh:
                    while fh.read(64 << 20):
                        pass
            pki: Pki = make_pki(root / "pki", [a_ip])
            plans = [
                (p.split(":")[0], *(int(x) for x in p.split(":")[1].split("x")))
                for p in args.plans.split(",")
            ]
            mooncake = ["--seed-mooncake"] if any(p[0] == "mooncake" for p in plans) else []
            a = run_daemon(
                ns_a, root / "a", "a", root / "a" / "model",
                ["--listen", f"{a_ip}:{PORT}", "--tls-cert", str(pki.server_cert),
                 "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
                 "--allow-seeding", *mooncake],
                hashes=root / "a" / "hashes",
            )  # fmt: skip
            results: dict[str, list[float]] = {}
            peer = [
                "--seed-from", f"{a_ip}:{PORT}", "--peer-tls-cert", str(pki.client_cert),
                "--peer-tls-key", str(pki.client_key), "--peer-tls-ca", str(pki.ca),
            ]  # fmt: skip
            client = [str(pki.ca), str(pki.client_cert), str(pki.client_key)]
            try:
                for r in range(args.rounds):
                    results.setdefault("link: sendfile, 1 connection", []).append(
                        bulk_link(ns_a, ns_b, a_ip, files, 1)
                    )
                    results.setdefault("link: sendfile, 4 connections", []).append(
                        bulk_link(ns_a, ns_b, a_ip, files, 4)
                    )
                    results.setdefault("link: curl from http.server", []).append(
                        curl_link(ns_a, ns_b, a_ip, root / "a" / "model", files)
                    )
                    for connections in (int(c) for c in args.raw.split(",") if c):
                        key = f"transfer alone: tcp plane, {connections} connections"
                        results.setdefault(key, []).append(
                            raw_plane(ns_b, f"{a_ip}:{PORT}", client, b_model, connections)
                        )
                    for plane, streams, chunk in plans:
                        b = run_daemon(
                            ns_b, root / "b", f"s{r}-{plane}-{streams}-{chunk}", b_model,
                            [*peer, "--seed-streams", str(streams),
                             "--seed-chunk-bytes", str(chunk << 20), "--seed-plane", plane],
                            hashes=root / "b" / f"hashes-seed-{r}-{plane}-{streams}-{chunk}",
                        )  # fmt: skip
                        try:
                            seeded = _event(b, "seeded")
                            loaded = _event(b, "loaded")
                            assert seeded["bytes"] == loaded["bytes"]
                        finally:
                            b.stop_and_check()
                        print(
                            "seeded:",
                            {k: v for k, v in seeded.items() if k.endswith("seconds")},
                            flush=True,
                        )
                        assert seeded["plane"] == plane, seeded
                        key = f"seed: {plane}, {streams} streams x {chunk} MiB"
                        results.setdefault(key, []).append(float(str(loaded["seconds"])))
                    hashes = root / "b" / f"hashes-files-{r}"
                    for label in ("cold hash cache", "warm hash cache"):
                        b = run_daemon(ns_b, root / "b", f"f{r}", b_model, [], hashes=hashes)
                        try:
                            loaded = _event(b, "loaded")
                        finally:
                            b.stop_and_check()
                        results.setdefault(f"files: own page cache, {label}", []).append(
                            float(str(loaded["seconds"]))
                        )
                        time.sleep(1.2)  # past the timestamp granule: the digests are kept
            finally:
                a.stop_and_check()
        print(f"model: {size / (1 << 30):.2f} GiB in {SHARDS} shards; {os.cpu_count()} CPUs")
        link = min(statistics.median(v) for k, v in results.items() if k.startswith("link"))
        print_rates(results, size, link, "x link")
        print("x link: the fastest link median's seconds over this path's (1.00 = link speed)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
