"""A peer that floods the daemon with KeepAlive streams, for tests/test_keepalive_fairness.py.

``python -m tests.keepalive_flooder SOCKET STREAMS IDS``: opens ``STREAMS`` KeepAlive streams
(a connection of its own per 100 streams) and sends messages of ``IDS`` made-up lease ids
on each, without pause, reading the answers. Prints ``flooding`` once gRPC has asked every
stream for its first message, then floods until it is killed or its stdin closes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import grpc

from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

STREAMS_PER_CONNECTION = 100


def main(socket: str, streams: int, ids: int) -> None:
    request = pb.KeepAliveRequest(lease_ids=[f"flood-{i:08d}" for i in range(ids)])
    stop = threading.Event()
    sent = threading.Semaphore(0)

    def requests() -> Iterator[pb.KeepAliveRequest]:
        sent.release()  # gRPC asks for the first message: the call is open
        while not stop.is_set():
            yield request

    def one(stub: pb_grpc.WeightCacheServiceStub) -> None:
        try:
            for _ in stub.KeepAlive(requests(), timeout=600):
                pass
        except grpc.RpcError:
            pass

    channels = [
        grpc.insecure_channel(f"unix:{socket}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-streams // STREAMS_PER_CONNECTION))
    ]
    for i in range(streams):
        stub = pb_grpc.WeightCacheServiceStub(channels[i // STREAMS_PER_CONNECTION])
        threading.Thread(target=one, args=(stub,), daemon=True).start()
    for _ in range(streams):
        sent.acquire()
    print("flooding", flush=True)
    sys.stdin.read()  # until the test closes it
    stop.set()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
