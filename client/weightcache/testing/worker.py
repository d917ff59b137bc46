"""A model worker: a separate process that gets weights with ``weightcache.load``.

Run as ``python -m weightcache.testing.worker``; :class:`weightcache.testing.driver.Worker`
drives it over pipes: one JSON command per line on stdin, one JSON message per
line back on the original stdout. Replies carry ``"reply"`` (the command's ``op``);
messages the worker sends on its own carry ``"event"`` (``lease_lost``, from the
``on_lease_lost`` callback, on the keepalive thread). File descriptor 1 is pointed at
stderr first, so nothing a library prints can mix into the protocol. EOF on stdin: the
worker closes what it loaded (releasing leases) and exits 0.

Commands (``key`` names one loaded result):

- ``load {key, path, kwargs, dump, lost_callback, capture_logs}``: ``weightcache.load``;
  with ``dump``, save the tensors it got to that safetensors file.
- ``dump {key, path}``: save the tensors (as they are now) to a safetensors file.
- ``invert {key}``: write to every tensor in place: bitwise NOT of each byte
  (``logical_not_`` for BOOL, to keep valid booleans).
- ``wait_ack {key, seconds}``: wait until the daemon acknowledged a keepalive renewal,
  so the lease is bound to this process's KeepAlive stream.
- ``wait_lost {key, seconds}``: wait for the lease's loss, then touch ``tensors``.
- ``close {key}``: ``LoadedWeights.close()``.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import torch
from safetensors.torch import save_file

import weightcache
from weightcache.testing.logs import capture_sdk_logs
from weightcache.testing.protocol import (
    Handler,
    describe,
    in_shared_memory,
    jsonable,
    protocol_out,
    serve_commands,
)


class WorkerState:
    """What the worker loaded, and what its lease-loss callbacks saw."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.weights: dict[str, weightcache.LoadedWeights] = {}
        self.lost: dict[str, tuple[float, weightcache.LeaseLostError]] = {}

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.out.write(json.dumps(message) + "\n")
            self.out.flush()

    def on_lost(self, key: str, err: weightcache.LeaseLostError) -> None:
        at = time.monotonic()
        self.lost[key] = (at, err)
        self.send({"event": "lease_lost", "key": key, "t": at, "error": describe(err)})

    # -- commands ------------------------------------------------------------------

    def load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = cmd["key"]
        weights, logs, start, end = timed_load(cmd, functools.partial(self.on_lost, key))
        elapsed = end - start
        if isinstance(weights, weightcache.WeightCacheError):
            return {
                "ok": False,
                "error": describe(weights),
                "elapsed": elapsed,
                "logs": jsonable(logs),
            }
        self.weights[key] = weights
        tensors = weights.tensors
        if cmd.get("dump"):
            dump(tensors, cmd["dump"])
        reason = weights.fallback_reason
        lease = weights.lease
        return {
            "ok": True,
            "source": weights.source,
            "model": weights.model,
            "fallback_reason": None
            if reason is None
            else {"code": reason.code, "detail": reason.detail, "components": reason.components},
            "lease": None if lease is None else {"ttl": lease.ttl, "validity": lease.validity},
            "names": list(tensors),
            "fingerprint": weights.fingerprint.digest,
            "metadata": weights.metadata,
            "in_shared_memory": in_shared_memory(tensors.values()),
            "elapsed": elapsed,
            "logs": jsonable(logs),
        }

    def dump(self, cmd: dict[str, Any]) -> dict[str, Any]:
        dump(self.weights[cmd["key"]].tensors, cmd["path"])
        return {"ok": True}

    def invert(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for tensor in self.weights[cmd["key"]].tensors.values():
            if tensor.dtype == torch.bool:
                tensor.logical_not_()
            elif tensor.numel():
                tensor.reshape(-1).view(torch.uint8).bitwise_not_()
        return {"ok": True}

    def wait_ack(self, cmd: dict[str, Any]) -> dict[str, Any]:
        lease = self.weights[cmd["key"]].lease
        assert lease is not None, "no lease to wait on"
        first = lease.last_ack
        deadline = time.monotonic() + cmd["seconds"]
        while lease.last_ack == first and lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"ok": lease.last_ack != first and lease.lost is None}

    def wait_lost(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = cmd["key"]
        weights = self.weights[key]
        lease = weights.lease
        assert lease is not None, "no lease to wait on"
        fired = lease.wait_lost(cmd["seconds"])
        reply: dict[str, Any] = {
            "ok": True,
            "fired": fired,
            "last_ack": lease.last_ack,
            "callback_t": self.lost[key][0] if key in self.lost else None,
        }
        try:
            weights.tensors  # noqa: B018 - the access is the test
        except weightcache.LeaseLostError as err:
            callback_err = self.lost[key][1] if key in self.lost else None
            reply["tensors_error"] = {
                **describe(err),
                "is_lease_lost": err is weights.lease_lost,
                "is_callback_error": err is callback_err,
            }
        else:
            reply["tensors_error"] = None
        return reply

    def close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.weights[cmd["key"]].close()
        return {"ok": True}

    def close_all(self) -> None:
        for weights in self.weights.values():
            weights.close()


def timed_load(
    cmd: dict[str, Any], on_lost: Callable[[weightcache.LeaseLostError], None]
) -> tuple[
    weightcache.LoadedWeights | weightcache.WeightCacheError,
    list[MutableMapping[str, Any]],
    float,
    float,
]:
    """``weightcache.load(cmd["path"], **cmd["kwargs"])`` as a worker's ``load`` command
    runs it: with ``on_lost`` as the lease-lost callback when ``cmd["lost_callback"]``, its
    logs captured when ``cmd["capture_logs"]``.

    Returns:
        The weights, or the ``WeightCacheError`` it raised; the captured log events; and
        ``time.monotonic()`` before and after the call, in seconds.
    """
    kwargs = dict(cmd.get("kwargs") or {})
    if cmd.get("lost_callback"):
        kwargs["on_lease_lost"] = on_lost
    logs: list[MutableMapping[str, Any]] = []
    start = time.monotonic()
    try:
        if cmd.get("capture_logs"):
            with capture_sdk_logs() as logs:
                weights = weightcache.load(cmd["path"], **kwargs)
        else:
            weights = weightcache.load(cmd["path"], **kwargs)
    except weightcache.WeightCacheError as err:
        return err, logs, start, time.monotonic()
    return weights, logs, start, time.monotonic()


def dump(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Save private copies of the tensors (views of one arena share storage)."""
    save_file({name: t.clone() for name, t in tensors.items()}, path)


def main() -> None:
    """Serve commands from stdin until EOF, then close everything loaded."""
    state = WorkerState(protocol_out())
    handlers: dict[str, Handler] = {
        "load": state.load,
        "dump": state.dump,
        "invert": state.invert,
        "wait_ack": state.wait_ack,
        "wait_lost": state.wait_lost,
        "close": state.close,
    }
    serve_commands(sys.stdin, handlers, state.send)
    state.close_all()


if __name__ == "__main__":
    main()
