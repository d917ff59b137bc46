"""HTTP over a Unix socket, for a server started with ``--uds`` (``weightcache-vllm
serve``): no TCP port is picked for it. Used by ``tests/vllm/`` and
``bench/vllm_serve_start.py``."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

#: Seconds one request may take.
TIMEOUT = 120.0


class UnixConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` to the server listening on the Unix socket ``path``."""

    def __init__(self, path: Path | str, timeout: float = TIMEOUT) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def request(
    path: Path | str,
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = TIMEOUT,
) -> Any:
    """``method url`` (a JSON ``body``, if any) on the server at ``path``; its JSON answer.

    Raises:
        OSError: no server listens there (yet).
        AssertionError: it answered another status than 200 (the answer's end quoted).
    """
    connection = UnixConnection(path, timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, url, data, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        text = answer.read()
        assert answer.status == 200, text[-2000:]
        return json.loads(text)
    finally:
        connection.close()
