"""Helpers for the tests: real daemons and workers in real processes, and checkpoints.

Nothing here mocks a weightcache component. A :class:`Daemon` is ``python -m
weightcache_service.cli preload ...`` on a real Unix socket; a :class:`Worker` is
``tests/worker.py`` in its own interpreter, driven over pipes, calling ``weightcache.load``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from safetensors.torch import save_file

import weightcache
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.server import SERVICE_NAME, socket_tag

TESTS = Path(__file__).resolve().parent
WORKER_SCRIPT = TESTS / "worker.py"
SHM_DIR = "/dev/shm"
#: Seconds a daemon may take to become ready, or to stop after SIGTERM. Generous: on a
#: loaded 2-core machine importing torch alone can take many seconds.
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
#: Seconds between readiness probes.
POLL = 0.05
#: Seconds a worker may take to answer one command (it imports torch first).
WORKER_TIMEOUT = 90.0
#: The log line a daemon writes for each segment of a dead predecessor it removes.
REMOVED_SEGMENT = "removed a dead daemon's segment"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
#: A tensor of at most 192 bytes (sampled fingerprints cover all of it), in shard 2.
SMALL_TENSOR = "layers.1.norm.bias"
#: One key only: safetensors writes __metadata__ from a hash map, in no fixed order.
METADATA = {"format": "pt"}


# -- processes -----------------------------------------------------------------------


def short_tempdir() -> Path:
    """A fresh 0700 folder under /tmp with a short name, for sockets (< 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))


def child_env() -> dict[str, str]:
    """Environment for daemons, workers and CLI runs: no inherited socket default."""
    env = dict(os.environ)
    env.pop("WEIGHTCACHE_SOCKET", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli_command() -> list[str]:
    """The installed ``weightcache`` console script (or the module, without one)."""
    script = Path(sys.executable).with_name("weightcache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "weightcache_service.cli"]


def run_cli(
    *args: str, timeout: float = 60.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``weightcache ARGS...`` (in ``cwd``) to completion and capture its output."""
    return subprocess.run(
        [*cli_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        check=False,
        cwd=cwd,
    )


def shm_segments(tag: str) -> list[str]:
    """Paths of the /dev/shm segments of daemons on the socket whose tag is ``tag``."""
    prefix = f"weightcache-{tag}-"
    return sorted(os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def private_shm(size: str, inodes: int) -> list[str]:
    """A command prefix that runs its command (by exec, same pid) in a private mount
    namespace with a fresh tmpfs of ``size`` bytes (mount(8) units) and ``inodes`` inodes
    on /dev/shm, seen from outside as ``/proc/PID/root/dev/shm``; the tmpfs vanishes with
    the process. Skips the test where unshare(1) or mount(8) is not permitted (not root)."""
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=1m weightcache-probe /dev/shm",
        ],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs: {probe.stderr.decode(errors='replace')}")
    script = (
        f'mount -t tmpfs -o size={size},nr_inodes={inodes} weightcache-test /dev/shm && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def private_segments(pid: int) -> list[str]:
    """Names of the segments in the private /dev/shm of process ``pid`` (:func:`private_shm`)."""
    return sorted(os.listdir(f"/proc/{pid}/root{SHM_DIR}"))


def health(socket: str, timeout: float = 1.0) -> str | None:
    """The readiness status name of the daemon at ``socket``, or None when none answers."""
    if not os.path.exists(socket):
        return None
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
            )
        except grpc.RpcError:
            return None
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return name


@contextlib.contextmanager
def service_stub(socket: str) -> Iterator[pb_grpc.WeightCacheServiceStub]:
    """A gRPC stub for the daemon at ``socket``; the channel closes on exit."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        yield pb_grpc.WeightCacheServiceStub(channel)


@dataclass(frozen=True)
class RpcFailure:
    """A failed RPC as the wire carries it: status code plus the one ErrorInfo."""

    code: grpc.StatusCode
    reason: str
    domain: str
    metadata: dict[str, str]
    message: str


def rpc_failure(exc: grpc.RpcError) -> RpcFailure:
    """Parse the ``google.rpc.Status`` of a failed call; asserts it holds one ErrorInfo."""
    assert isinstance(exc, grpc.Call), exc
    status = rpc_status.from_call(exc)
    assert status is not None, f"no rich status on {exc.code()}: {exc.details()}"
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, status
    return RpcFailure(
        code=exc.code(),
        reason=infos[0].reason,
        domain=infos[0].domain,
        metadata=dict(infos[0].metadata),
        message=status.message,
    )


class Daemon:
    """A ``weightcache preload`` process on a Unix socket, stderr logged to a file."""

    def __init__(
        self, socket: str, args: Sequence[str], log_path: Path, wrap: Sequence[str] = ()
    ) -> None:
        self.socket = socket
        self.tag = socket_tag(socket)
        self.log_path = log_path
        self.killed = False
        command = [sys.executable, "-m", "weightcache_service.cli", "preload", *args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*wrap, *command, "--socket", socket],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """Everything the daemon wrote so far."""
        return self.log_path.read_text(errors="replace")

    def segments(self) -> list[str]:
        """/dev/shm segments of daemons on this socket (this one and dead predecessors)."""
        return shm_segments(self.tag)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Poll the readiness health check every 50 ms until SERVING.

        Raises:
            AssertionError: the daemon exited or was not ready in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited with {self.proc.returncode} before ready:\n{self.log()}"
                )
            if health(self.socket) == "SERVING":
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not ready after {timeout} s:\n{self.log()}")
            time.sleep(POLL)

    def stop(self) -> int:
        """SIGTERM, wait, then SIGKILL as a fallback; returns the exit status.

        Raises:
            AssertionError: it did not stop on SIGTERM in time (it was SIGKILLed then).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.killed = True
                raise AssertionError(
                    f"daemon pid {self.pid} ignored SIGTERM; SIGKILLed:\n{self.log()}"
                ) from None
        return self.proc.returncode

    def kill(self) -> float:
        """SIGKILL the daemon (a crash) and reap it; returns ``time.monotonic()`` at the kill."""
        self.killed = True
        at = time.monotonic()
        self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)
        return at


class DaemonPool:
    """Daemons started by one fixture; :meth:`close` stops them and checks the leftovers.

    Args:
        sock_dir: a short folder for sockets (removed by :meth:`close`).
        log_dir: where daemon logs go.
    """

    def __init__(self, sock_dir: Path, log_dir: Path) -> None:
        self.sock_dir = sock_dir
        self.log_dir = log_dir
        self.daemons: list[Daemon] = []

    def socket(self, name: str = "d") -> str:
        """A socket path in the pool's short folder."""
        path = str(self.sock_dir / f"{name}.sock")
        assert len(os.fsencode(path)) < 107, path
        return path

    def start(
        self,
        models: Sequence[str | os.PathLike[str]] = (),
        *,
        socket: str | None = None,
        dtype: str | None = None,
        args: Sequence[str] = (),
        wait: bool = True,
        wrap: Sequence[str] = (),
    ) -> Daemon:
        """Start ``weightcache preload MODELS...`` and (by default) wait until it is ready;
        ``wrap`` is a command prefix that ends by exec'ing the daemon (same pid)."""
        argv = [str(m) for m in models]
        if dtype is not None:
            argv += ["--dtype", dtype]
        argv += list(args)
        log_path = self.log_dir / f"daemon-{len(self.daemons)}.log"
        socket = socket or self.socket(f"d{len(self.daemons)}")
        daemon = Daemon(socket, argv, log_path, wrap)
        self.daemons.append(daemon)
        if wait:
            daemon.wait_ready()
        return daemon

    def clean_after_crash(self, socket: str) -> list[str]:
        """Start and stop a fresh daemon on ``socket``: it must remove the segments a
        SIGKILLed predecessor left. Returns the paths it removed.

        Raises:
            AssertionError: it did not stop cleanly, left segments, or did not log each
                removal.
        """
        leftover = shm_segments(socket_tag(socket))
        fresh = self.start((), socket=socket)
        rc = fresh.stop()
        log = fresh.log()
        assert rc == 0, f"clean-up daemon exited {rc}:\n{log}"
        assert shm_segments(fresh.tag) == [], log
        for path in leftover:
            assert any(REMOVED_SEGMENT in line and path in line for line in log.splitlines()), (
                f"{path} was not reported removed:\n{log}"
            )
        return leftover

    def close(self) -> None:
        """Stop every daemon still running, clean up after crashed ones, then check that no
        socket, lock file or segment of any of them remains; removes the socket folder.

        Raises:
            AssertionError: listing everything that was left or went wrong.
        """
        errors: list[str] = []
        try:
            for daemon in reversed(list(self.daemons)):
                try:
                    rc = daemon.stop()
                except AssertionError as exc:
                    errors.append(str(exc))
                    continue
                if rc != 0 and not daemon.killed:
                    errors.append(f"daemon pid {daemon.pid} exited {rc}:\n{daemon.log()}")
            for socket in dict.fromkeys(d.socket for d in self.daemons):
                tag = socket_tag(socket)
                if os.path.lexists(socket) or shm_segments(tag):
                    try:
                        self.clean_after_crash(socket)
                    except AssertionError as exc:
                        errors.append(str(exc))
                for path in (socket, socket + ".lock", *shm_segments(tag)):
                    if os.path.lexists(path):
                        errors.append(f"left behind: {path}")
                        with contextlib.suppress(OSError):
                            os.unlink(path)
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        if errors:
            raise AssertionError("\n".join(errors))


class WorkerDiedError(AssertionError):
    """The worker process ended while the test waited for a message."""


def next_reply(
    op: str, deadline: float, read: Callable[[float], dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """Read messages until the reply to ``op``; events that come first go to ``events``."""
    while True:
        message = read(deadline)
        if "reply" in message:
            assert message["reply"] == op, message
            return message
        events.append(message)


def next_event(
    name: str, timeout: float, read: Callable[[float], dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The next event called ``name``: from ``events`` (kept earlier) or read on."""
    deadline = time.monotonic() + timeout
    while True:
        for i, message in enumerate(events):
            if message.get("event") == name:
                return events.pop(i)
        events.append(read(deadline))


class Worker:
    """``tests/worker.py`` in its own interpreter, driven by JSON lines over pipes."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(),
            )
        self._buffer = b""
        self._events: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, op: str, **fields: Any) -> None:
        """Send one command without waiting for its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, op: str, *, timeout: float = WORKER_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """Send a command and return its reply (events that arrive first are kept)."""
        self.send(op, **fields)
        deadline = time.monotonic() + timeout
        return next_reply(op, deadline, self._read_message, self._events)

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        key: str = "w",
        dump: Path | None = None,
        lost_callback: bool = False,
        capture_logs: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``weightcache.load(path, **kwargs)`` in the worker, kept there under ``key``;
        with ``dump``, the tensors it got are saved to that safetensors file."""
        return self.request(
            "load",
            key=key,
            path=str(path),
            kwargs=kwargs,
            dump=None if dump is None else str(dump),
            lost_callback=lost_callback,
            capture_logs=capture_logs,
        )

    def event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event called ``name`` the worker sends on its own."""
        return next_event(name, timeout, self._read_message, self._events)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"worker pid {self.pid} silent:\n{self.log()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(STOP_TIMEOUT)
                raise WorkerDiedError(
                    f"worker pid {self.pid} ended with {self.proc.returncode}:\n{self.log()}"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def kill(self) -> int:
        """SIGKILL the worker and reap it; returns its exit status."""
        self.proc.kill()
        return self.proc.wait(STOP_TIMEOUT)

    def close(self) -> None:
        """End the worker: EOF on stdin (it releases its leases and exits), SIGKILL if it
        lingers; close the pipes."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


class WorkerPool:
    """Workers started by one fixture; :meth:`close` ends them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.workers: list[Worker] = []

    def start(self) -> Worker:
        worker = Worker(self.log_dir / f"worker-{len(self.workers)}.log")
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


# -- checkpoints ---------------------------------------------------------------------


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random: every bit pattern, NaN payloads too."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def reference_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint's worth of tensors: BF16, F16, F32, F8_E4M3, BOOL, I64, a zero-size
    tensor and a 0-d tensor; floats hold arbitrary bit patterns (NaNs, infinities, -0.0)."""
    gen = torch.Generator().manual_seed(seed)
    embed = _random_bits((64, 32), torch.bfloat16, gen)
    embed.view(-1)[:4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-40])
    return {
        "embed.weight": embed,
        "layers.0.attn.weight": _random_bits((16, 24), torch.float16, gen),
        "layers.0.mlp.weight": _random_bits((32, 33), torch.float32, gen),
        "layers.0.mlp.fp8_weight": _random_bits((8, 16), torch.float8_e4m3fn, gen),
        "layers.0.mask": torch.rand((5, 7), generator=gen) > 0.5,
        "layers.0.position_ids": torch.randint(-(2**62), 2**62, (33,), generator=gen),
        "layers.0.empty": torch.zeros((0, 4), dtype=torch.float32),
        "layers.1.scale": torch.tensor(-3.25 + seed, dtype=torch.float32),
        SMALL_TENSOR: torch.arange(1, 9, dtype=torch.float32) + seed,
    }


#: Which tensors go to which shard of a sharded checkpoint.
SHARD_OF: dict[str, str] = {
    "embed.weight": SHARD_1,
    "layers.0.attn.weight": SHARD_1,
    "layers.0.mlp.weight": SHARD_1,
    "layers.0.mlp.fp8_weight": SHARD_1,
    "layers.0.mask": SHARD_2,
    "layers.0.position_ids": SHARD_2,
    "layers.0.empty": SHARD_2,
    "layers.1.scale": SHARD_2,
    SMALL_TENSOR: SHARD_2,
}


def write_single(folder: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """``folder/model.safetensors`` holding ``tensors``; returns ``folder``."""
    folder.mkdir(parents=True)
    save_file(dict(tensors), str(folder / SINGLE_FILE), metadata=METADATA)
    return folder


def write_sharded(folder: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Two shards plus ``model.safetensors.index.json`` (split by :data:`SHARD_OF`)."""
    folder.mkdir(parents=True)
    for shard in (SHARD_1, SHARD_2):
        part = {n: t for n, t in tensors.items() if SHARD_OF[n] == shard}
        save_file(part, str(folder / shard), metadata=METADATA)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: SHARD_OF[n] for n in tensors}}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


@dataclass(frozen=True)
class Checkpoints:
    """The shared, read-only test checkpoints (copy them before editing).

    Attributes:
        tensors: what ``single`` and ``sharded`` hold.
        single: folder with one ``model.safetensors`` (model name ``single``).
        sharded: two shards and an index (model name ``sharded``).
        other: a single-file checkpoint with different tensor names (``other``).
        other_sharded: ``sharded``'s layout and names with different bytes.
    """

    tensors: dict[str, torch.Tensor]
    single: Path
    sharded: Path
    other: Path
    other_sharded: Path


def make_checkpoints(root: Path) -> Checkpoints:
    """Write the test checkpoints under ``root``."""
    tensors = reference_tensors(seed=0)
    other = {f"other.{i}": torch.full((3, i + 1), float(i)) for i in range(3)}
    return Checkpoints(
        tensors=tensors,
        single=write_single(root / "single", tensors),
        sharded=write_sharded(root / "sharded", tensors),
        other=write_single(root / "other", other),
        other_sharded=write_sharded(root / "other-sharded", reference_tensors(seed=1)),
    )


def copy_with_zeroed_tensor(src: Path, dst: Path, name: str) -> str:
    """Copy a checkpoint and overwrite one tensor's bytes with zeros, header untouched.

    Returns the name of the shard file that changed.
    """
    shutil.copytree(src, dst)
    info = weightcache.open_checkpoint(dst).tensors[name]
    with open(dst / info.shard, "r+b") as fh:
        fh.seek(info.begin)
        assert any(fh.read(info.nbytes)), "the tensor to zero is zero already"
        fh.seek(info.begin)
        fh.write(bytes(info.nbytes))
    return info.shard


def _raw_file(path: Path, header: bytes, data: bytes = b"", header_len: int | None = None) -> None:
    length = len(header) if header_len is None else header_len
    path.write_bytes(length.to_bytes(8, "little") + header + data)


def _json(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header).encode()


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _bad_header_length(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16)})
    _raw_file(folder / SINGLE_FILE, header, bytes(16), header_len=10_000)


def _offsets_past_end(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [16], 0, 64)}), bytes(16))


def _invalid_json(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, b'{"a": {"dtype": "F32", "shape": [4], ', bytes(16))


def _unknown_dtype(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F7", [4], 0, 16)}), bytes(16))


def _shape_bytes_disagree(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [3], 0, 16)}), bytes(16))


def _overlapping_offsets(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 8, 24)})
    _raw_file(folder / SINGLE_FILE, header, bytes(24))


def _index_names_missing_shard(folder: Path) -> None:
    save_file({"a": torch.ones(4)}, str(folder / SHARD_1))
    index = {"metadata": {}, "weight_map": {"a": SHARD_1, "b": SHARD_2}}
    (folder / INDEX_FILE).write_text(json.dumps(index))


def _duplicate_tensor_name(folder: Path) -> None:
    entry = json.dumps(_entry("F32", [4], 0, 16))
    header = f'{{"a": {entry}, "a": {entry}}}'.encode()
    _raw_file(folder / SINGLE_FILE, header, bytes(16))


def _gap_between_tensors(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 24, 40)})
    _raw_file(folder / SINGLE_FILE, header, bytes(40))


def _trailing_bytes(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [4], 0, 16)}), bytes(20))


def _empty_weight_map(folder: Path) -> None:
    save_file({"a": torch.ones(4)}, str(folder / SHARD_1))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {}}))


def _dtype_not_a_string(folder: Path) -> None:
    header = _json({"a": {"dtype": [], "shape": [4], "data_offsets": [0, 16]}})
    _raw_file(folder / SINGLE_FILE, header, bytes(16))


def _sub_byte_dtype(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F4", [4], 0, 2)}), bytes(2))


@dataclass(frozen=True)
class Malformed:
    """A way to break a checkpoint, and what the refusal must say about it."""

    write: Callable[[Path], None]
    message: str


MALFORMED: dict[str, Malformed] = {
    "bad-header-length": Malformed(_bad_header_length, "runs past the end"),
    "offsets-past-end": Malformed(_offsets_past_end, "past the end of the"),
    "invalid-json": Malformed(_invalid_json, "not valid JSON"),
    "unknown-dtype": Malformed(_unknown_dtype, "unknown dtype 'F7'"),
    "shape-bytes-disagree": Malformed(_shape_bytes_disagree, "needs 12"),
    "overlapping-offsets": Malformed(_overlapping_offsets, "overlaps another"),
    "index-missing-shard": Malformed(_index_names_missing_shard, "which is missing"),
    # What the safetensors reader refuses too (its format rules; issue 9, item 10).
    "duplicate-tensor-name": Malformed(_duplicate_tensor_name, "names 'a' twice"),
    "gap-between-tensors": Malformed(
        _gap_between_tensors, "8 bytes of no tensor before tensor 'b'"
    ),
    "trailing-bytes": Malformed(_trailing_bytes, "4 trailing bytes after the last tensor"),
    "empty-weight-map": Malformed(_empty_weight_map, "'weight_map' maps no tensor"),
    "sub-byte-dtype": Malformed(_sub_byte_dtype, "dtype F4 packs elements below a byte"),
    "dtype-not-a-string": Malformed(_dtype_not_a_string, "unknown dtype []"),
}


def write_malformed(folder: Path, case: str) -> Path:
    """A checkpoint folder broken the way ``case`` (a key of :data:`MALFORMED`) says."""
    folder.mkdir(parents=True)
    MALFORMED[case].write(folder)
    return folder


# -- comparing -----------------------------------------------------------------------


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat ``uint8`` tensor (row-major)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """Same names, and per name the same dtype, shape and bytes (NaN payloads included)."""
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{name}: bytes differ"


def flipped(tensor: torch.Tensor) -> torch.Tensor:
    """What the worker's ``invert`` command turns a tensor into (see tests/worker.py)."""
    if tensor.dtype == torch.bool:
        return torch.logical_not(tensor)
    out = tensor.clone()
    if out.numel():
        out.reshape(-1).view(torch.uint8).bitwise_not_()
    return out


def assert_attached(reply: dict[str, Any]) -> None:
    """A worker's load reply says it got the weights from the daemon (else: why not)."""
    assert reply["ok"], reply.get("error")
    assert reply["source"] == "cache", reply["fallback_reason"]
    assert reply["fallback_reason"] is None


def get_model(socket: str, name: str) -> pb.Model:
    """The daemon's view of one held model."""
    with service_stub(socket) as stub:
        reply: pb.GetModelResponse = stub.GetModel(pb.GetModelRequest(name=name), timeout=10)
    return reply.model


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = POLL) -> float:
    """Poll ``predicate`` until true; returns the seconds it took.

    Raises:
        AssertionError: still false after ``timeout`` seconds.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition still false after {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
