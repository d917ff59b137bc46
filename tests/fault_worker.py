"""A fork server of model workers for the fault and lifecycle tests.

Starting a worker that imports torch takes seconds, tens of seconds on a loaded machine;
the stress test needs dozens of them. So this script imports torch and weightcache once
(it creates no thread of its own and no gRPC channel) and forks each worker from there:
every worker is then a real, separate process with its own pid, its own KeepAlive stream
and its own mappings, started in milliseconds. ``weightcache`` supports this: its
per-process KeepAlive registry is emptied in a forked child.

The zygote (this script's main process) reads JSON commands on stdin, one per line, and
answers each with one JSON line on stdout:

- ``fork {address, log}``: fork a worker that connects to the Unix socket ``address``
  (the test listens there) and logs to the file ``log``; answers ``{pid}``.
- ``wait {pid, timeout}``: reap a worker; answers ``{status}``: its exit status as
  ``subprocess`` reports it (negative: killed by that signal), or None if it still runs.

EOF on stdin: every worker still running is continued and killed, and all are reaped.

A worker speaks the same kind of line protocol over its socket. It sends
``{"event": "hello", "pid": PID}`` first; then one reply per command (``"reply"``: the
command's ``op``), and events of its own (``lease_lost``, from the ``on_lease_lost``
callback). EOF: it closes what it loaded (releasing its leases) and exits 0.

Worker commands (``key`` names one loaded result):

- ``load {key, path, kwargs, lost_callback, capture_logs}``: ``weightcache.load``. The
  reply carries the source, fallback reason, lease (id, instance, ttl, validity) and the
  :func:`tensor_digest` of the tensors it got. The tensors dict is kept, so that its bytes
  can be checked again after the lease is gone (``LoadedWeights.tensors`` may raise then).
- ``digest {key}``: the digest of the kept tensors now, and what ``tensors`` raises.
- ``wait_ack {key, seconds}``: wait until the daemon acknowledged a renewal sent after the
  load returned (then the lease is bound to this process's KeepAlive stream).
- ``wait_lost {key, seconds}``: wait for the lease's loss to be handled.
- ``lease {key}``: the lease's state: lost (and why), revoked, kept (revoked, mapping
  kept), the daemon instance it renews with.
- ``maps``: this process's mappings of weightcache segments, from ``/proc/self/smaps``.
- ``close {key}``: ``LoadedWeights.close()``.
- ``stress {plan, seconds, expected}``: attach and release in a loop for ``seconds``, round
  robin over ``plan`` (a list of ``[path, kwargs]``), checking every result against
  ``expected[path]`` (a digest); answers one record per attempt.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch

import weightcache
from weightcache.testing.protocol import (
    SHM_MAPPING,
    Handler,
    jsonable,
    serve_commands,
    tensor_digest,
)
from weightcache.testing.protocol import describe as describe_with_components
from weightcache.testing.worker import timed_load


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as JSON: class, reason, detail, metadata."""
    return describe_with_components(exc, components=False)


def segment_maps() -> list[dict[str, Any]]:
    """This process's mappings of weightcache segments, with their smaps counters (kB)."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                current = None
                if SHM_MAPPING in line:
                    path = line.split(None, 5)[5].strip()
                    current = {"path": path.removesuffix(" (deleted)")}
                    current["deleted"] = path.endswith("(deleted)")
                    out.append(current)
            elif current is not None and head[0].endswith(":") and len(head) == 3:
                current[head[0][:-1]] = int(head[1])
    return out


class WorkerState:
    """What a worker loaded, and what its lease-loss callbacks saw."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.weights: dict[str, weightcache.LoadedWeights] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.lost: dict[str, float] = {}
        self.first_ack: dict[str, float] = {}

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            self.conn.sendall(data)

    def on_lost(self, key: str, err: weightcache.LeaseLostError) -> None:
        at = time.monotonic()
        self.lost[key] = at
        self.send({"event": "lease_lost", "key": key, "t": at, "error": describe(err)})

    # -- commands ------------------------------------------------------------------

    def load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = cmd["key"]
        weights, logs, t0, t1 = timed_load(cmd, functools.partial(self.on_lost, key))
        if isinstance(weights, weightcache.WeightCacheError):
            return {"ok": False, "error": describe(weights), "t0": t0, "t1": t1}
        self.weights[key] = weights
        tensors = self.tensors[key] = weights.tensors
        reason = weights.fallback_reason
        lease = weights.lease
        if lease is not None:
            # Read at once: the first renewal is sent when the lease is added, so its
            # acknowledgement normally comes after this.
            self.first_ack[key] = lease.last_ack
        return {
            "ok": True,
            "source": weights.source,
            "model": weights.model,
            "fallback_reason": None
            if reason is None
            else {"code": reason.code, "detail": reason.detail},
            "lease": None
            if lease is None
            else {
                "id": lease.lease_id,
                "instance_id": lease.instance_id,
                "ttl": lease.ttl,
                "validity": lease.validity,
            },
            "digest": tensor_digest(tensors),
            "t0": t0,
            "t1": t1,
            "logs": jsonable(logs),
        }

    def digest(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = cmd["key"]
        reply: dict[str, Any] = {"ok": True, "digest": tensor_digest(self.tensors[key])}
        try:
            self.weights[key].tensors  # noqa: B018 - the access is the test
        except weightcache.LeaseLostError as err:
            reply["tensors_error"] = describe(err)
        else:
            reply["tensors_error"] = None
        return reply

    def wait_ack(self, cmd: dict[str, Any]) -> dict[str, Any]:
        lease = self.weights[cmd["key"]].lease
        assert lease is not None, "no lease to wait on"
        first = self.first_ack[cmd["key"]]
        deadline = time.monotonic() + cmd["seconds"]
        while lease.last_ack == first and lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"ok": lease.last_ack != first and lease.lost is None}

    def wait_lost(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = cmd["key"]
        lease = self.weights[key].lease
        assert lease is not None, "no lease to wait on"
        fired = lease.wait_lost(cmd["seconds"])
        return {"ok": True, "fired": fired, "last_ack": lease.last_ack, **self._lease(lease)}

    def lease(self, cmd: dict[str, Any]) -> dict[str, Any]:
        lease = self.weights[cmd["key"]].lease
        assert lease is not None, "no lease"
        return {"ok": True, **self._lease(lease)}

    @staticmethod
    def _lease(lease: Any) -> dict[str, Any]:
        return {
            "lost": None if lease.lost is None else describe(lease.lost),
            "revoked": lease.revoked,
            "kept": lease.kept,
            "instance_id": lease.instance_id,
        }

    def maps(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "maps": segment_maps()}

    def close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.weights[cmd["key"]].close()
        return {"ok": True}

    def stress(self, cmd: dict[str, Any]) -> dict[str, Any]:
        plan: list[tuple[str, dict[str, Any]]] = [(p, dict(k)) for p, k in cmd["plan"]]
        expected: dict[str, str] = cmd["expected"]
        records: list[dict[str, Any]] = []
        end = time.monotonic() + cmd["seconds"]
        i = 0
        while time.monotonic() < end:
            path, kwargs = plan[i % len(plan)]
            i += 1
            record: dict[str, Any] = {"path": path, "mode": kwargs.get("mode", "zero_copy")}
            record["t0"] = time.monotonic()
            try:
                with weightcache.load(path, **kwargs) as weights:
                    record["source"] = weights.source
                    reason = weights.fallback_reason
                    record["code"] = None if reason is None else reason.code
                    record["detail"] = None if reason is None else reason.detail
                    record["equal"] = tensor_digest(weights.tensors) == expected[path]
            except weightcache.WeightCacheError as err:
                record["error"] = describe(err)
            record["t1"] = time.monotonic()
            records.append(record)
        return {"ok": True, "records": records}

    def close_all(self) -> None:
        for weights in self.weights.values():
            with contextlib.suppress(weightcache.WeightCacheError):
                weights.close()


def serve(conn: socket.socket) -> None:
    """A worker's command loop over its connection to the test."""
    state = WorkerState(conn)
    handlers: dict[str, Handler] = {
        "load": state.load,
        "digest": state.digest,
        "wait_ack": state.wait_ack,
        "wait_lost": state.wait_lost,
        "lease": state.lease,
        "maps": state.maps,
        "close": state.close,
        "stress": state.stress,
    }
    state.send({"event": "hello", "pid": os.getpid()})
    with conn.makefile("r", encoding="utf-8") as lines:
        serve_commands(lines, handlers, state.send, describe)
    state.close_all()


def worker_main(address: str, log: str) -> None:
    """Entry point of a forked worker; never returns."""
    status = 0
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        serve(conn)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def exit_status(raw: int) -> int:
    """A waitpid status as ``subprocess`` reports it."""
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def main() -> None:
    out = sys.stdout
    children: dict[int, int | None] = {}

    def reap(pid: int, timeout: float) -> int | None:
        if children.get(pid) is not None:
            return children[pid]
        deadline = time.monotonic() + timeout
        while True:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                children[pid] = exit_status(raw)
                return children[pid]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fork":
            out.flush()
            pid = os.fork()
            if pid == 0:
                worker_main(cmd["address"], cmd["log"])
            children[pid] = None
            reply: dict[str, Any] = {"pid": pid}
        elif cmd["op"] == "wait":
            reply = {"status": reap(cmd["pid"], cmd["timeout"])}
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for pid, status in children.items():
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            reap(pid, 10.0)


if __name__ == "__main__":
    main()
