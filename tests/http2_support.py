"""A raw HTTP/2 client for attacks no gRPC library makes: a stream whose receive window is
zero (the daemon can send it nothing), connections that stay idle.

Frames and HPACK as RFC 9113 and RFC 7541 define them; headers are sent as literals
without indexing (RFC 7541, 6.2.2), which every decoder must accept.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113, 4.1)."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: str, value: str) -> bytes:
    # RFC 7541 6.2.2: literal header field without indexing, new name; lengths < 127.
    raw_name, raw_value = name.encode(), value.encode()
    assert len(raw_name) < 127 and len(raw_value) < 127
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def grpc_headers(path: str) -> bytes:
    """The HPACK block of a gRPC request to ``path`` (``/package.Service/Method``)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    return b"".join(_literal(name, value) for name, value in fields)


def grpc_message(payload: bytes) -> bytes:
    """A length-prefixed, uncompressed gRPC message."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


class ZeroWindowStream:
    """A connection that opens one gRPC stream with an initial window of zero bytes and
    never grants more (no WINDOW_UPDATE): the server can send it headers, never data.
    A thread answers SETTINGS and PING (so the connection stays up) and counts the frames
    received by type.

    Args:
        connect: a connected socket (Unix or TCP).
        path: the gRPC method, e.g. ``/grpc.health.v1.Health/Watch``.
        request: the serialized request message.
    """

    def __init__(self, connect: socket.socket, path: str, request: bytes) -> None:
        self.sock = connect
        self.frames: dict[int, int] = {}
        self.closed = threading.Event()
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 0)
        self.sock.sendall(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(HEADERS, END_HEADERS, 1, grpc_headers(path))
            + frame(DATA, END_STREAM, 1, grpc_message(request))
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    payload = buffer[9 : 9 + length]
                    buffer = buffer[9 + length :]
                    self.frames[kind] = self.frames.get(kind, 0) + 1
                    if kind == SETTINGS and not flags & ACK:
                        self.sock.sendall(frame(SETTINGS, ACK, 0))
                    elif kind == PING and not flags & ACK:
                        self.sock.sendall(frame(PING, ACK, 0, payload))
        except OSError:
            return
        finally:
            self.closed.set()

    def close(self) -> None:
        """Close the connection and wait for the reader."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def unix_connection(path: str) -> socket.socket:
    """A connected Unix stream socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock
