"""A seeding peer driven by the seeding tests: a separate process (run in another network
namespace with ``ip netns exec``) that calls a daemon's seeding RPCs with the client
certificate it is given, as a fleet daemon would, one JSON command per line on stdin, one
JSON answer per line on stdout.

Run as ``python -m tests.seed_peer TARGET CA CERT KEY CHECKPOINT``. Commands:

- ``{"op": "begin", "ttl", "connections"}``: BeginSeed for the checkpoint (its
  fingerprint components, computed from its files; ``ttl`` seconds asked, 0 by default;
  ``connections`` sendfile data-plane connections asked, 0 by default) -> ``{"lease_id",
  "arena_size", "data_port", "secrets": [hex, ...]}``.
- ``{"op": "data", "port", "secret", "ranges"}``: open a data-plane connection to the
  target's host at ``port``, send the hello (``secret`` in hex, ``ranges`` as ``[[offset,
  length], ...]``) and read until the daemon closes it -> ``{"bytes", "sha256"}`` of
  what arrived.
- ``{"op": "silent", "port"}``: open a data-plane connection, send half a hello, and read
  until the daemon closes it -> ``{"bytes"}`` received.
- ``{"op": "crowd", "port", "count"}``: open ``count`` data-plane connections one after
  another, each sending half a hello, hold them all, then read each until the daemon
  closes it -> ``{"bytes": [received, ...]}``.
- ``{"op": "list"}``: ListLeases -> ``{"leases": [{"lease_id", "model", "label", "ttl"}]}``
  (``ttl`` in whole seconds).
- ``{"op": "read", "lease_id", "length", "chunk_bytes"}``: ReadSeedData from offset 0,
  read whole -> ``{"bytes"}``.
- ``{"op": "end", "lease_id"}``: EndSeed -> ``{}``.
- ``{"op": "open", "lease_id", "streams", "length", "chunk_bytes"}``: open that many
  ReadSeedData streams on this one connection, read one message of each and no more;
  they stay open until ``{"op": "close"}`` -> ``{"opened", "refused": [reason, ...]}``.

A refused call answers ``{"code", "reason", "metadata"}`` (its gRPC code and ErrorInfo).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import sys
from pathlib import Path
from typing import Any

import grpc

from tests.support import rpc_failure
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc


def _components(checkpoint: str) -> list[pb.FingerprintComponent]:
    import weightcache
    from weightcache.core.protocol import fingerprint_pb

    fp = weightcache.compute_fingerprint(
        weightcache.open_checkpoint(checkpoint), weightcache.Recipe(), weightcache.Placement()
    )
    return list(fingerprint_pb(fp).components)


def _refused(exc: grpc.RpcError) -> dict[str, Any]:
    try:
        failure = rpc_failure(exc)
    except AssertionError:  # no ErrorInfo: a transport error, a deadline
        return {"code": exc.code().name, "reason": "", "metadata": {}}
    return {"code": failure.code.name, "reason": failure.reason, "metadata": failure.metadata}


def _data(target: str, port: int, secret: str, ranges: list[list[int]]) -> dict[str, Any]:
    from weightcache_service.sendfile_plane import HELLO, RANGE

    host = target.rpartition(":")[0].strip("[]")
    digest, got = hashlib.sha256(), 0
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            HELLO.pack(bytes.fromhex(secret), len(ranges))
            + b"".join(RANGE.pack(offset, length) for offset, length in ranges)
        )
        with contextlib.suppress(ConnectionResetError):  # closed with the hello unread
            while chunk := sock.recv(1 << 20):
                digest.update(chunk)
                got += len(chunk)
    return {"bytes": got, "sha256": digest.hexdigest()}


def _silent(target: str, port: int) -> dict[str, Any]:
    host = target.rpartition(":")[0].strip("[]")
    got = 0
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(bytes(16))  # half a secret, and then nothing
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
    return {"bytes": got}


def _crowd(target: str, port: int, count: int) -> dict[str, Any]:
    host = target.rpartition(":")[0].strip("[]")
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(count):
            sock = stack.enter_context(socket.create_connection((host, port), timeout=30))
            sock.sendall(bytes(16))  # half a secret, and then nothing
            socks.append(sock)
        got = []
        for sock in socks:
            n = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 20):
                    n += len(chunk)
            got.append(n)
    return {"bytes": got}


def main() -> None:
    target, ca, cert, key, checkpoint = sys.argv[1:6]
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes(),
        certificate_chain=Path(cert).read_bytes(),
    )
    # A chunk of the largest size (4 MiB) and its framing: over gRPC's 4 MiB default.
    channel = grpc.secure_channel(
        target, creds, options=[("grpc.max_receive_message_length", 32 << 20)]
    )
    stub = pb_grpc.WeightCacheServiceStub(channel)
    held: list[Any] = []
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            answer: dict[str, Any] = {}
            if op == "begin":
                begun = stub.BeginSeed(
                    pb.BeginSeedRequest(
                        components=_components(checkpoint),
                        ttl_seconds=command.get("ttl", 0),
                        data_connections=command.get("connections", 0),
                    ),
                    timeout=20,
                )
                answer = {
                    "lease_id": begun.lease_id,
                    "arena_size": begun.arena_size,
                    "data_port": begun.data_port,
                    "secrets": [s.hex() for s in begun.data_secrets],
                }
            elif op == "crowd":
                answer = _crowd(target, command["port"], command["count"])
            elif op == "silent":
                answer = _silent(target, command["port"])
            elif op == "data":
                answer = _data(target, command["port"], command["secret"], command["ranges"])
            elif op == "list":
                listed = stub.ListLeases(pb.ListLeasesRequest(), timeout=20)
                answer = {
                    "leases": [
                        {"lease_id": h.lease.lease_id, "model": h.lease.model,
                         "label": h.worker.label, "ttl": h.lease.ttl.seconds}
                        for h in listed.leases
                    ]
                }  # fmt: skip
            elif op == "read":
                request = pb.ReadSeedDataRequest(
                    lease_id=command["lease_id"],
                    length=command["length"],
                    chunk_bytes=command["chunk_bytes"],
                )
                got = sum(len(r.data) for r in stub.ReadSeedData(request, timeout=30))
                answer = {"bytes": got}
            elif op == "end":
                stub.EndSeed(pb.EndSeedRequest(lease_id=command["lease_id"]), timeout=20)
            elif op == "open":
                request = pb.ReadSeedDataRequest(
                    lease_id=command["lease_id"],
                    length=command["length"],
                    chunk_bytes=command["chunk_bytes"],
                )
                refused = []
                for _ in range(command["streams"]):
                    call = stub.ReadSeedData(request, timeout=120)
                    try:
                        next(call)
                        held.append(call)
                    except grpc.RpcError as exc:
                        refused.append(_refused(exc)["reason"])
                answer = {"opened": len(held), "refused": refused}
            elif op == "close":
                for call in held:
                    call.cancel()
                held.clear()
        except grpc.RpcError as exc:
            answer = _refused(exc)
        print(json.dumps(answer), flush=True)
    channel.close()


if __name__ == "__main__":
    main()
