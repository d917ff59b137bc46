"""What gRPC Python streaming itself carries on this machine (issue 30's ceiling).

One process: a grpc.aio server streaming 1 GiB in pre-serialized 4 MiB messages to sync
clients on loopback, plaintext and mutual TLS, 1 and 4 streams. No arena, no copy into
shared memory, no hashing: the upper bound of ``GrpcStreamPlane`` here.

    .venv/bin/python bench/seed_grpc_ceiling.py
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.security_support import Pki, make_pki

TOTAL = 1 << 30
CHUNK = 4 << 20
PAYLOAD = b"\x00" * CHUNK


async def _serve(port: int, creds: grpc.ServerCredentials | None, ready: threading.Event) -> None:
    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(TOTAL // CHUNK):
            yield PAYLOAD

    handler = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=lambda b: b, response_serializer=None
    )
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("x.X", {"S": handler}),))
    if creds is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        server.add_secure_port(f"127.0.0.1:{port}", creds)
    await server.start()
    ready.set()
    await asyncio.sleep(120)
    await server.stop(0)


def run(pki: Pki, tls: bool, streams: int, port: int) -> float:
    """GB/s of ``streams`` parallel streams of 1 GiB each."""
    creds = (
        grpc.ssl_server_credentials(
            [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
            root_certificates=pki.ca.read_bytes(),
            require_client_auth=True,
        )
        if tls
        else None
    )
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(_serve(port, creds, ready)), daemon=True).start()
    ready.wait()
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.ssl_target_name_override", "127.0.0.1"),
    ]
    if tls:
        client = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        )
        channel = grpc.secure_channel(f"127.0.0.1:{port}", client, options=options)
    else:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    method = channel.unary_stream(
        "/x.X/S", request_serializer=lambda b: b, response_deserializer=None
    )

    def one() -> None:
        for _ in method(b""):
            pass

    start = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    return streams * TOTAL / (time.perf_counter() - start) / 1e9


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    try:
        pki = make_pki(folder / "pki", ["127.0.0.1"])
        port = 17100
        for tls in (False, True):
            for streams in (1, 4):
                port += 1
                gbps = run(pki, tls, streams, port)
                label = "mutual TLS" if tls else "plaintext"
                print(f"{label:10} {streams} stream(s): {gbps:.2f} GB/s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
