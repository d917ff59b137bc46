"""The worker line protocol, both ends: JSON commands in, JSON replies and events out.

A worker process reads one JSON command per line (``{"op": ..., ...}``) and answers each
with one JSON line tagged ``"reply": op``; messages it sends on its own carry ``"event"``.
The worker side: :func:`protocol_out`, :func:`serve_commands`, and how values travel
(:func:`describe`, :func:`jsonable`, :func:`tensor_digest`, :func:`in_shared_memory`). The
driving side: :func:`next_reply`, :func:`next_event`. ``weightcache.testing.worker`` and
``weightcache.testing.driver`` are one pair built on it; a test may build its own worker
with other commands on the same protocol.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import torch

import weightcache

#: What a mapping of a daemon's CPU segment looks like in ``/proc/self/maps``.
SHM_MAPPING = "/dev/shm/weightcache-"

#: A worker's answer to one command: the command in, the reply's fields out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor in name order: name, dtype, shape and raw bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def describe(exc: BaseException, *, components: bool = True) -> dict[str, Any]:
    """An exception as JSON: class, reason, detail, metadata, and (with ``components``)
    the components of a fingerprint mismatch."""
    out: dict[str, Any] = {"type": type(exc).__name__, "detail": str(exc)}
    if isinstance(exc, weightcache.WeightCacheError):
        out["reason"] = exc.reason
        out["metadata"] = dict(exc.metadata)
    if components and isinstance(exc, weightcache.FingerprintMismatchError):
        out["components"] = exc.components
    if not isinstance(exc, weightcache.WeightCacheError):
        out["traceback"] = traceback.format_exc()
    return out


def jsonable(value: Any) -> Any:
    """``value`` with every dict key a string and every value that is not JSON replaced
    by its ``repr`` (lists and tuples become lists)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return repr(value)


def shm_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of weightcache /dev/shm segments."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if SHM_MAPPING in line:
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def in_shared_memory(tensors: Iterable[torch.Tensor]) -> bool | None:
    """Whether every non-empty tensor's bytes lie in a mapped daemon segment (zero-copy)."""
    ranges = shm_ranges()
    checks = [
        any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)
        for t in tensors
        if t.numel()
    ]
    return all(checks) if checks else None


def protocol_out() -> TextIO:
    """The original stdout, for protocol lines; fd 1 is then pointed at stderr, so nothing
    a library prints can mix into the protocol."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return out


def serve_commands(
    lines: Iterable[str],
    handlers: dict[str, Handler],
    send: Callable[[dict[str, Any]], None],
    describe: Callable[[BaseException], dict[str, Any]] = describe,
) -> None:
    """Answer each JSON command line with its handler's reply (an error reply if the
    handler raised), tagged ``"reply": op``."""
    for line in lines:
        cmd = json.loads(line)
        try:
            reply = handlers[cmd["op"]](cmd)
        except Exception as exc:
            reply = {"ok": False, "error": describe(exc)}
        send({"reply": cmd["op"], **reply})


def next_reply(
    op: str, deadline: float, read: Callable[[float], dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """Read messages (``read(deadline)``, deadline on ``time.monotonic``) until the reply to
    ``op``; events that come first are appended to ``events``.

    Raises:
        AssertionError: a reply to another command came first (the protocol is out of step).
        Exception: whatever ``read`` raises (a dead or silent worker).
    """
    while True:
        message = read(deadline)
        if "reply" in message:
            assert message["reply"] == op, message
            return message
        events.append(message)


def next_event(
    name: str, timeout: float, read: Callable[[float], dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The next event called ``name``: from ``events`` (kept earlier, removed from there) or
    read on, for up to ``timeout`` seconds.

    Raises:
        Exception: whatever ``read`` raises (a dead or silent worker).
    """
    deadline = time.monotonic() + timeout
    while True:
        for i, message in enumerate(events):
            if message.get("event") == name:
                return events.pop(i)
        events.append(read(deadline))
