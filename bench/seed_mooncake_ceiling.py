"""What Mooncake's transfer engine carries over TCP between two network namespaces
(issue 30's question: is it a data plane that can reach 0.8x of the link?).

Run as root (it makes two network namespaces and a veth pair, removed at the end):

    .venv/bin/python -m pip install mooncake-transfer-engine-non-cuda  # not a dependency
    apt-get install libibverbs1  # the engine loads it at import, even for TCP
    MC_TCP_SLICE_SIZE=16777216 .venv/bin/python bench/seed_mooncake_ceiling.py --gib 2 --rounds 2

Namespace A: one process with a ``--gib`` GiB anonymous buffer of random bytes,
registered with a ``TransferEngine`` (``P2PHANDSHAKE``, protocol ``tcp``). Namespace B:
for each mode, a fresh process that registers a fresh destination buffer of the same
size and pulls A's buffer (``transfer_sync_read`` of the whole, ``batch_transfer_sync_read``
of 16 or 64 MiB pieces, or several threads each reading 64 MiB pieces), with
``MC_TCP_LANES_PER_PEER`` as the mode says; the time is the transfer's only (engine
set-up and the handshake excluded), and the sha256 of what arrived is compared with A's.
Interleaved in the same rounds: the sendfile link of ``bench/seed.py`` (the same bytes as
files, page cache warm, 4 connections). No daemon, no hashing in the timed part: the
upper bound of a Mooncake data plane here.

It also checks, once, what a registered region lets a peer do: a ``transfer_sync_write``
from B into A's region (does A see the bytes?), a read past the region's end, and a read
after A unregistered it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from seed import IP, bulk_link, namespaces, print_rates  # bench/seed.py

from weightcache.testing.daemon import short_tempdir

PIECE = 64 << 20

_SERVER = r"""
import ctypes, hashlib, mmap, os, sys
from mooncake.engine import TransferEngine
ip, size, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = TransferEngine()
assert engine.initialize(ip, "P2PHANDSHAKE", "tcp", "") == 0
buf = mmap.mmap(-1, size)
block = os.urandom(64 << 20)
for at in range(0, size, len(block)):
    buf[at:at + len(block)] = block[: size - at]
# The same bytes as files, for the sendfile link.
os.makedirs(folder, exist_ok=True)
step = size // 8
for i in range(8):
    with open(os.path.join(folder, f"part{i}"), "wb") as fh:
        fh.write(buf[i * step:(i + 1) * step])
digest = hashlib.sha256(buf).hexdigest()
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert engine.register_memory(addr, size) == 0
print(engine.get_rpc_port(), addr, digest, flush=True)
for line in sys.stdin:
    word = line.strip()
    if word == "head":
        print(buf[:16].hex(), flush=True)
    elif word == "unregister":
        print(engine.unregister_memory(addr), flush=True)
"""

_READER = r"""
import ctypes, hashlib, mmap, sys, threading, time
from mooncake.engine import TransferEngine
ip, target, raddr, size, mode, digest = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5], sys.argv[6]
engine = TransferEngine()
assert engine.initialize(ip, "P2PHANDSHAKE", "tcp", "") == 0
buf = mmap.mmap(-1, size)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert engine.register_memory(addr, size) == 0
# The handshake and first connection, outside the timed part.
assert engine.transfer_sync_read(target, addr, raddr, 4096) == 0
kind, _, arg = mode.partition(":")
start = time.perf_counter()
if kind == "one":
    assert engine.transfer_sync_read(target, addr, raddr, size) == 0
elif kind == "batch":
    piece = int(arg) << 20
    offs = list(range(0, size, piece))
    rc = engine.batch_transfer_sync_read(
        target, [addr + o for o in offs], [raddr + o for o in offs],
        [min(piece, size - o) for o in offs])
    assert rc == 0, rc
elif kind == "threads":
    n, piece = int(arg), 64 << 20
    offs = list(range(0, size, piece))
    errors = []
    def run(mine):
        for o in mine:
            if engine.transfer_sync_read(target, addr + o, raddr + o, min(piece, size - o)):
                errors.append(o)
    ts = [threading.Thread(target=run, args=(offs[i::n],)) for i in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert not errors, errors
seconds = time.perf_counter() - start
ok = hashlib.sha256(buf).hexdigest() == digest
assert engine.unregister_memory(addr) == 0
print(seconds, ok, flush=True)
"""

_PROBE = r"""
import ctypes, mmap, sys
from mooncake.engine import TransferEngine
ip, target, raddr, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
engine = TransferEngine()
assert engine.initialize(ip, "P2PHANDSHAKE", "tcp", "") == 0
buf = mmap.mmap(-1, 1 << 20)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert engine.register_memory(addr, 1 << 20) == 0
buf[:16] = b"written by B!!!!"
print("write", engine.transfer_sync_write(target, addr, raddr, 1 << 20), flush=True)
print("past_end", engine.transfer_sync_read(target, addr, raddr + size - 4096, 1 << 20), flush=True)
input()
print("after_unregister", engine.transfer_sync_read(target, addr, raddr, 4096), flush=True)
"""


def reader(
    ns: str, b_ip: str, target: str, region: tuple[int, int, str], *, mode: str, lanes: int
) -> float:
    """Seconds B's reader took to pull A's ``region`` (address, size, sha256) in ``mode``
    with ``lanes`` TCP lanes.

    Raises:
        RuntimeError: the reader failed, or the bytes it got are not A's.
    """
    raddr, size, digest = region
    env = dict(os.environ, MC_TCP_LANES_PER_PEER=str(lanes), MC_LOG_LEVEL="ERROR")
    done = subprocess.run(
        [IP, "netns", "exec", ns, sys.executable, "-c", _READER, b_ip, target, str(raddr),
         str(size), mode, digest],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{mode} lanes={lanes}: {done.stderr[-2000:]}")
    seconds, ok = done.stdout.split()
    if ok != "True":
        raise RuntimeError(f"{mode} lanes={lanes}: the bytes differ")
    return float(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--modes",
        default="one:1,batch:16:1,batch:64:1,batch:64:4,threads:2:1,threads:4:4",
        help="MODE[:ARG]:LANES, comma-separated: one, batch:PIECE_MIB, threads:N",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root (it makes network namespaces)", file=sys.stderr)
        return 2
    size = int(args.gib * (1 << 30))
    root = short_tempdir()
    try:
        with namespaces() as (ns_a, ns_b, a_ip, b_ip):
            env = dict(os.environ, MC_LOG_LEVEL="ERROR")
            server = subprocess.Popen(
                [IP, "netns", "exec", ns_a, sys.executable, "-c", _SERVER, a_ip, str(size),
                 str(root / "files")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            try:
                assert server.stdin is not None and server.stdout is not None
                port, raddr, digest = server.stdout.readline().split()
                target = f"{a_ip}:{port}"
                listening = subprocess.run(
                    [IP, "netns", "exec", ns_a, "ss", "-ltnH"],
                    capture_output=True, text=True, check=False,
                ).stdout  # fmt: skip
                print("A's listening sockets:", " ".join(
                    line.split()[3] for line in listening.splitlines()))  # fmt: skip
                files = sorted((root / "files").iterdir())
                results: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    results.setdefault("link: sendfile, 4 connections", []).append(
                        bulk_link(ns_a, ns_b, a_ip, files, 4)
                    )
                    for spec in args.modes.split(","):
                        mode, _, lanes = spec.rpartition(":")
                        key = f"mooncake tcp: {mode}, {lanes} lane(s)"
                        results.setdefault(key, []).append(
                            reader(
                                ns_b,
                                b_ip,
                                target,
                                (int(raddr), size, digest),
                                mode=mode,
                                lanes=int(lanes),
                            )
                        )
                # What a registered region lets a peer do.
                probe = subprocess.Popen(
                    [IP, "netns", "exec", ns_b, sys.executable, "-c", _PROBE, b_ip, target,
                     raddr, str(size)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                )  # fmt: skip
                assert probe.stdin is not None and probe.stdout is not None
                wrote = probe.stdout.readline().split()[1]
                past = probe.stdout.readline().split()[1]
                server.stdin.write("head\n")
                server.stdin.flush()
                head = bytes.fromhex(server.stdout.readline().strip())
                server.stdin.write("unregister\n")
                server.stdin.flush()
                server.stdout.readline()
                probe.stdin.write("\n")
                probe.stdin.flush()
                after = probe.stdout.readline().split()[1]
                probe.wait(60)
                print(
                    f"B's transfer_sync_write into A's registered region: rc {wrote}, A's "
                    f"first bytes now {head!r}; a read past its end: rc {past}; a read "
                    f"after A unregistered it: rc {after}"
                )
            finally:
                if server.stdin:
                    server.stdin.close()
                server.wait(60)
        print(f"buffer: {size / (1 << 30):.2f} GiB; {os.cpu_count()} CPUs; "
              f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        link = statistics.median(results["link: sendfile, 4 connections"])
        print_rates(results, size, link, "x link")
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
