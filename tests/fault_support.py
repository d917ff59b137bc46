"""Helpers for the fault and lifecycle tests: forked workers, big checkpoints, raw RPCs.

Workers are forked from one zygote process per test module (``tests/fault_worker.py``),
which imported torch and weightcache once; each test gets its own :class:`Children` pool,
ended before its daemons stop. See ``tests/fault_worker.py`` for the protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors.torch import save_file

from tests.support import service_stub
from weightcache._loader import _acquire_request
from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.fingerprint import DEFAULT_LEVEL, Level, compute_fingerprint
from weightcache.core.recipe import Placement, Recipe
from weightcache.testing import METADATA, SINGLE_FILE, STOP_TIMEOUT, Daemon, DaemonPool, child_env
from weightcache.testing.daemon import wait_or_kill
from weightcache.testing.protocol import next_event, next_reply, tensor_digest
from weightcache.v1 import weight_cache_service_pb2 as pb

ZYGOTE_SCRIPT = Path(__file__).resolve().parent / "fault_worker.py"
#: Seconds the zygote may take to import torch and answer its first command.
ZYGOTE_TIMEOUT = 120.0
#: Seconds a worker may take to answer one command.
CHILD_TIMEOUT = 60.0


class Zygote:
    """``tests/fault_worker.py``: forks workers on request and reaps them."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ZYGOTE_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(),
            )

    def _command(self, patience: float, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(fields) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], patience)
        assert ready, f"zygote silent for {patience} s:\n{self.log_path.read_text()}"
        line = self.proc.stdout.readline()
        assert line, f"zygote ended:\n{self.log_path.read_text()}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def fork(self, address: str, log: Path) -> int:
        """Fork a worker that connects to ``address``; returns its pid."""
        pid: int = self._command(ZYGOTE_TIMEOUT, op="fork", address=address, log=str(log))["pid"]
        return pid

    def wait(self, pid: int, timeout: float) -> int | None:
        """Reap a worker: its exit status (negative: the signal), or None if still running."""
        status: int | None = self._command(timeout + 30, op="wait", pid=pid, timeout=timeout)[
            "status"
        ]
        return status

    def close(self) -> None:
        """EOF: the zygote kills and reaps every worker left, then exits."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            wait_or_kill(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ChildDiedError(AssertionError):
    """The worker's connection closed while the test waited for a message."""


class Child:
    """One forked worker, driven over its Unix socket connection."""

    def __init__(self, zygote: Zygote, pid: int, conn: socket.socket, log_path: Path) -> None:
        self.zygote = zygote
        self.pid = pid
        self.conn = conn
        self.log_path = log_path
        self.status: int | None = None
        self._buffer = b""
        self._events: list[dict[str, Any]] = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, op: str, **fields: Any) -> None:
        """Send one command without waiting for its reply."""
        self.conn.sendall((json.dumps({"op": op, **fields}) + "\n").encode())

    def reply(self, op: str, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
        """The reply to the command ``op`` sent last (events that come first are kept)."""
        deadline = time.monotonic() + timeout
        return next_reply(op, deadline, self.read_message, self._events)

    def request(self, op: str, *, timeout: float = CHILD_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """Send a command and return its reply."""
        self.send(op, **fields)
        return self.reply(op, timeout)

    def load(
        self, path: str | os.PathLike[str], *, key: str = "w", **options: Any
    ) -> dict[str, Any]:
        """``weightcache.load(path, **kwargs)`` in the worker (see :meth:`send_load`)."""
        self.send_load(path, key=key, **options)
        return self.reply("load")

    def send_load(
        self,
        path: str | os.PathLike[str],
        *,
        key: str = "w",
        lost_callback: bool = False,
        capture_logs: bool = False,
        **kwargs: Any,
    ) -> None:
        """Start ``weightcache.load(path, **kwargs)`` in the worker; :meth:`reply` ends it."""
        self.send(
            "load",
            key=key,
            path=str(path),
            kwargs=kwargs,
            lost_callback=lost_callback,
            capture_logs=capture_logs,
        )

    def event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event called ``name`` the worker sent on its own."""
        return next_event(name, timeout, self.read_message, self._events)

    def read_message(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"worker pid {self.pid} silent:\n{self.log()}")
            ready, _, _ = select.select([self.conn], [], [], remaining)
            if not ready:
                continue
            chunk = self.conn.recv(1 << 20)
            if not chunk:
                self.status = self.zygote.wait(self.pid, STOP_TIMEOUT)
                raise ChildDiedError(f"worker pid {self.pid} ended ({self.status}):\n{self.log()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP the worker and return once every one of its threads is stopped.

        ``kill`` only queues the signal: on a loaded machine a thread of the worker (its
        KeepAlive stream's) ran on for milliseconds and answered the daemon's REVOKING
        with a Release, which a test of a holder that never releases must not see.
        """
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(state in "Tt" for state in _thread_states(self.pid)):
            assert time.monotonic() < deadline, f"worker {self.pid} did not stop"
            time.sleep(0.001)

    def kill(self) -> int | None:
        """SIGKILL the worker and reap it; returns its exit status."""
        self.signal(signal.SIGKILL)
        self.status = self.zygote.wait(self.pid, STOP_TIMEOUT)
        return self.status

    def close(self) -> None:
        """EOF (the worker releases its leases and exits 0); SIGCONT + SIGKILL if it lingers."""
        if self.status is None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_WR)
            self.status = self.zygote.wait(self.pid, STOP_TIMEOUT)
            if self.status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGCONT)
                    os.kill(self.pid, signal.SIGKILL)
                self.status = self.zygote.wait(self.pid, STOP_TIMEOUT)
        self.conn.close()


class Children:
    """Workers of one test, forked from the module's zygote; :meth:`close` ends them all.

    Args:
        zygote: the module's fork server.
        sock_dir: a short folder for the listening socket the workers connect to.
        log_dir: where worker logs go.
    """

    def __init__(self, zygote: Zygote, sock_dir: Path, log_dir: Path) -> None:
        self.zygote = zygote
        self.log_dir = log_dir
        self.address = str(sock_dir / "workers.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(128)
        self.children: list[Child] = []

    def start(self, count: int = 1, timeout: float = CHILD_TIMEOUT) -> list[Child]:
        """Fork ``count`` workers and wait until each has connected."""
        pids: dict[int, Path] = {}
        for _ in range(count):
            log = self.log_dir / f"worker-{len(self.children) + len(pids)}.log"
            pids[self.zygote.fork(self.address, log)] = log
        conns: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        while len(conns) < count:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.listener], [], [], max(remaining, 0))
            assert ready, f"only {len(conns)} of {count} workers connected in {timeout} s"
            conn, _ = self.listener.accept()
            hello = b""
            while not hello.endswith(b"\n"):
                chunk = conn.recv(1)
                assert chunk, "a worker closed its connection before saying hello"
                hello += chunk
            conns[json.loads(hello)["pid"]] = conn
        assert set(conns) == set(pids)
        started = [Child(self.zygote, pid, conns[pid], log) for pid, log in pids.items()]
        self.children.extend(started)
        return started

    def one(self) -> Child:
        [child] = self.start(1)
        return child

    def close(self) -> None:
        try:
            for child in self.children:
                child.close()
        finally:
            for child in self.children:
                child.conn.close()
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)


def start_ready(
    daemons: DaemonPool,
    models: Sequence[Path] = (),
    *,
    socket: str | None = None,
    args: Sequence[str] = (),
) -> Daemon:
    """Start a daemon and wait until it is ready (the harness's ``READY_TIMEOUT``)."""
    return daemons.start(models, socket=socket, args=args)


@contextlib.contextmanager
def zygote_for(log_dir: Path) -> Iterator[Zygote]:
    zygote = Zygote(log_dir / "zygote.log")
    try:
        yield zygote
    finally:
        zygote.close()


# -- checkpoints -----------------------------------------------------------------------


def write_big_checkpoint(
    folder: Path, tensors: int, tensor_mib: int, largest_mib: int, seed: int = 0
) -> tuple[str, int, int]:
    """``folder/model.safetensors`` with random F32 tensors: ``tensors - 1`` of
    ``tensor_mib`` MiB and one of ``largest_mib`` MiB, written one at a time.

    Returns the digest of the tensors (:func:`tensor_digest`), their total bytes and the
    largest tensor's bytes.
    """
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(tensors):
        mib = largest_mib if i == 0 else tensor_mib
        raw = torch.randint(0, 256, (mib * 2**20,), dtype=torch.uint8, generator=gen)
        out[f"layers.{i}.weight"] = raw.view(torch.float32).reshape(mib * 256, 1024)
    save_file(out, str(folder / SINGLE_FILE), metadata=METADATA)
    total = sum(t.nbytes for t in out.values())
    return tensor_digest(out), total, largest_mib * 2**20


def write_sized_checkpoint(folder: Path, nbytes: int, seed: int = 0) -> Path:
    """A single-file checkpoint of one F32 tensor of ``nbytes`` (a multiple of 1024)."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    save_file({"w": raw.view(torch.float32).reshape(-1, 256)}, str(folder / SINGLE_FILE))
    return folder


def disk_digest(path: str | os.PathLike[str]) -> str:
    """The digest of a checkpoint's tensors read from disk by weightcache itself."""
    import weightcache

    return tensor_digest(weightcache.load_from_disk(path).tensors)


# -- raw RPCs --------------------------------------------------------------------------


def acquire_request(
    path: str | os.PathLike[str], level: Level = DEFAULT_LEVEL
) -> pb.AcquireRequest:
    """The AcquireRequest by fingerprint that ``weightcache.load(path)`` sends when no model
    was loaded from its very files (stored recipe, rank 0 of 1)."""
    checkpoint = open_checkpoint(path)
    placement = Placement()
    pipeline = Recipe().build(checkpoint, placement)
    fp = compute_fingerprint(checkpoint, pipeline, placement, level)
    return _acquire_request(checkpoint.root, fp, 10.0)


def keepalive_once(socket_path: str, lease_ids: list[str]) -> pb.KeepAliveResponse:
    """Open a KeepAlive stream, send one request naming ``lease_ids``, return the answer."""
    with service_stub(socket_path) as stub:
        stream = stub.KeepAlive(iter([pb.KeepAliveRequest(lease_ids=lease_ids)]), timeout=10)
        reply: pb.KeepAliveResponse = next(stream)
        stream.cancel()
        return reply


def list_models(socket_path: str) -> dict[str, pb.Model]:
    with service_stub(socket_path) as stub:
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    return {m.name: m for m in reply.models}


def unlinked(socket_path: str) -> list[tuple[str, int, int]]:
    """The unlinked arenas ListModels reports: (model, bytes, revoked leases)."""
    with service_stub(socket_path) as stub:
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    return [(u.model, u.size_bytes, u.lease_count) for u in reply.unlinked]


def server_info(socket_path: str) -> pb.GetServerInfoResponse:
    with service_stub(socket_path) as stub:
        reply: pb.GetServerInfoResponse = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return reply


def evict(socket_path: str, name: str, *, force: bool = False) -> pb.EvictResponse:
    with service_stub(socket_path) as stub:
        reply: pb.EvictResponse = stub.Evict(pb.EvictRequest(name=name, force=force), timeout=10)
    return reply


def refused(fn: Any) -> grpc.RpcError:
    """Run ``fn()`` and return the gRPC error it must raise."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded; it should have been refused")


def proc_status(pid: int) -> Mapping[str, int]:
    """The ``kB`` fields of ``/proc/PID/status`` (VmRSS, VmHWM, ...), in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def _thread_states(pid: int) -> list[str]:
    """The state letter (proc(5), field 3 of ``/proc/PID/task/TID/stat``) of each thread."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
            states.append(stat[stat.rindex(b")") + 2 :].split()[0].decode())
    return states
