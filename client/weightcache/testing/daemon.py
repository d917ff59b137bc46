"""Real ``weightcache preload`` daemons on Unix sockets in temporary folders, for tests.

A :class:`Daemon` is ``python -m weightcache_service.cli preload ARGS... --socket S`` in
its own process, stdout and stderr logged to a file. It is ready when the start-up health
check (service ``weightcache.v1.WeightCacheService``) answers SERVING: every start-up
preload has ended, successfully or not (the ``readiness`` service, which waits for the
required models to be READY, would never answer SERVING for a daemon whose model fails on
purpose). :func:`run_daemon` is the one-daemon context manager (start, wait,
check every model is READY, stop, check nothing is left); :class:`DaemonPool` holds the
several daemons of one test and checks them all at the end.

This module imports no daemon code: it drives the daemon through its command line and
its gRPC API only, as a user's test would.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightcache.core.rpc import SERVICE_NAME, target
from weightcache.core.sockets import MAX_SOCKET_PATH, SHM_DIR, segment_tag, tag_prefix
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

#: Seconds a daemon may take to become ready. Generous: on a loaded 2-core machine
#: importing torch alone can take many seconds, and a preload reads whole checkpoints.
READY_TIMEOUT = 150.0
#: Seconds a daemon may take to exit after SIGTERM before it is SIGKILLed: more than its
#: default drain timeout (30 s) and shutdown grace, so a daemon that waits out a holder
#: is not mistaken for one that ignores SIGTERM.
STOP_TIMEOUT = 45.0
#: Seconds between readiness probes.
POLL = 0.05
#: The health-check service name that is SERVING once every start-up preload has ended.
#: The log line a daemon writes for each segment of a dead predecessor it removes.
REMOVED_SEGMENT = "removed a dead daemon's segment"


def wait_or_kill(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, else SIGKILL and reap it.

    Returns:
        Whether it had to be killed.
    """
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True
    return False


class HarnessError(AssertionError):
    """A daemon or worker of the test harness misbehaved; the message says how, with the
    process's log. An ``AssertionError``, so that test runners report it as a failure."""


class DaemonStartError(HarnessError):
    """A daemon exited before it was ready, was not ready in time, or (when asked) ended
    its start-up preloads without every model READY.

    Attributes:
        returncode: its exit status, or None when it is still running.
        log: everything it wrote.
    """

    def __init__(self, message: str, returncode: int | None, log: str) -> None:
        super().__init__(f"{message}\n--- daemon log ---\n{log}")
        self.returncode = returncode
        self.log = log


class DaemonStopError(HarnessError):
    """A daemon ignored SIGTERM (it was SIGKILLed), exited non-zero, or left its socket, its
    lock file or a shared-memory segment behind (they were removed)."""


def short_tempdir() -> Path:
    """A fresh 0700 folder under /tmp with a short name, for sockets (< 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for daemons and workers: this process's, without a ``WEIGHTCACHE_SOCKET``
    default (each child is told its socket), single-threaded OpenMP (the harness runs many
    processes at once), unbuffered output (logs are read while they run), plus ``extra``."""
    env = dict(os.environ)
    env.pop("WEIGHTCACHE_SOCKET", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def shm_segments(tag: str) -> list[str]:
    """Paths of the /dev/shm segments of daemons on the socket whose tag is ``tag``."""
    prefix = tag_prefix(tag)
    return sorted(os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def health(socket: str, timeout: float = 1.0) -> str | None:
    """The start-up status name (``SERVING``, ``NOT_SERVING``, ...; service
    ``weightcache.v1.WeightCacheService``) of the daemon at ``socket``, or None when none
    answers within ``timeout`` seconds."""
    if not os.path.exists(socket):
        return None
    with grpc.insecure_channel(target(socket)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
            )
        except grpc.RpcError:
            return None
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return name


def list_models(socket: str, timeout: float = 10.0) -> list[pb.Model]:
    """The daemon's ``ListModels``: every model it holds, sorted by name.

    Raises:
        grpc.RpcError: the call failed (no daemon, or it refused).
    """
    with grpc.insecure_channel(target(socket)) as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        reply: pb.ListModelsResponse = stub.ListModels(pb.ListModelsRequest(), timeout=timeout)
    return list(reply.models)


#: The line each TCP listener logs once bound, with the port it bound (``port=N`` on the
#: console, ``"port": N`` in JSON), by listener: ``--listen``, ``--health-listen``,
#: ``--metrics-listen``.
LISTENER_EVENTS = {
    "tcp": "listening on tcp",
    "health": "health listening",
    "metrics": "metrics listening",
}
_PORT = re.compile(r'\bport"?\s*[=:]\s*(\d+)')


class Daemon:
    """A ``weightcache preload`` process on a Unix socket, stdout and stderr logged to a file.

    Started at construction; :meth:`wait_ready` waits for it, :meth:`stop` ends it.

    Args:
        socket: the Unix socket path it serves (under 107 bytes).
        args: the arguments after ``preload`` (model paths, flags), ``--socket`` excluded.
        log_path: the file its output goes to (created or truncated).
        wrap: a command prefix that ends by exec'ing the daemon (same pid), e.g.
            ``unshare ...``.
        env: variables added to its environment (:func:`child_env`).
        new_session: start it in its own session, so a Ctrl-C in the terminal reaches only
            the caller (which then stops it); for scripts.
    """

    def __init__(
        self,
        socket: str,
        args: Sequence[str],
        log_path: Path,
        wrap: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        self.socket = socket
        self.tag = segment_tag(socket)
        self.log_path = log_path
        self.killed = False
        self.ready_seconds: float | None = None
        command = [sys.executable, "-m", "weightcache_service.cli", "preload", *args]
        self.started_at = time.monotonic()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*wrap, *command, "--socket", socket],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(env),
                start_new_session=new_session,
            )

    @property
    def pid(self) -> int:
        """The daemon's process id (that of ``wrap``'s first command, which execs it)."""
        return self.proc.pid

    def log(self) -> str:
        """Everything the daemon wrote so far."""
        return self.log_path.read_text(errors="replace")

    def bound_port(self, listener: str, timeout: float = 0.0) -> int:
        """The TCP port a listener of this daemon bound, from its log line
        (:data:`LISTENER_EVENTS`). Start the daemon with port 0 (``127.0.0.1:0``) and read
        the port here: a port picked free beforehand can be taken by another process
        before the daemon binds it.

        Args:
            listener: ``"tcp"``, ``"health"`` or ``"metrics"``.
            timeout: seconds to wait for the line (0: it must be there already, as it is
                once :meth:`wait_ready` returned).

        Raises:
            KeyError: an unknown listener.
            HarnessError: no such line within ``timeout`` (the listener was not asked
                for, or failed), or the daemon exited first.
        """
        event = LISTENER_EVENTS[listener]
        deadline = time.monotonic() + timeout
        while True:
            log = self.log()
            for line in log.splitlines():
                found = _PORT.search(line) if event in line else None
                if found is not None:
                    return int(found.group(1))
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                raise HarnessError(f"no {event!r} line with a port in the daemon's log:\n{log}")
            time.sleep(POLL)

    def segments(self) -> list[str]:
        """/dev/shm segments of daemons on this socket (this one and dead predecessors)."""
        return shm_segments(self.tag)

    def leftovers(self) -> list[str]:
        """What a stopped daemon must not leave: its socket, lock file and segments."""
        paths = [self.socket, self.socket + ".lock"]
        return [p for p in paths if os.path.lexists(p)] + self.segments()

    def wait_ready(self, timeout: float = READY_TIMEOUT, *, models: int | None = None) -> float:
        """Poll the readiness health check every :data:`POLL` seconds until SERVING.

        Args:
            timeout: seconds from now.
            models: also require (``ListModels``) at least this many models, all READY:
                the start-up preloads all succeeded (a path preloads one model per
                tensor-parallel rank, so a path can count for several).

        Returns:
            Seconds from the start of the process to readiness.

        Raises:
            DaemonStartError: it exited, or was not ready within ``timeout`` seconds, or
                (``models``) a model failed or was refused, or ListModels failed.
        """
        deadline = time.monotonic() + timeout
        while health(self.socket) != "SERVING":
            if self.proc.poll() is not None:
                raise DaemonStartError(
                    f"daemon exited with {self.proc.returncode} before ready",
                    self.proc.returncode,
                    self.log(),
                )
            if time.monotonic() > deadline:
                raise DaemonStartError(f"daemon not ready after {timeout} s", None, self.log())
            time.sleep(POLL)
        self.ready_seconds = time.monotonic() - self.started_at
        if models is not None:
            self._check_models(models)
        return self.ready_seconds

    def _check_models(self, expected: int) -> None:
        try:
            held = list_models(self.socket)
        except grpc.RpcError as exc:
            raise DaemonStartError(f"ListModels failed: {exc}", None, self.log()) from None
        ready = [m for m in held if m.state == pb.MODEL_STATE_READY]
        if len(ready) == len(held) >= expected:
            return
        # A path refused at admission never becomes a model: the log says why.
        states = [f"{m.name} {pb.ModelState.Name(m.state)} {m.error}".strip() for m in held]
        raise DaemonStartError(
            f"daemon ready with {len(ready)} of {expected} models READY: {states}",
            None,
            self.log(),
        )

    def stop(self) -> int:
        """SIGTERM, wait up to :data:`STOP_TIMEOUT` seconds, then SIGKILL.

        Returns:
            The exit status (negative: killed by that signal).

        Raises:
            DaemonStopError: it did not stop on SIGTERM in time (it was SIGKILLed then).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if wait_or_kill(self.proc):
                self.killed = True
                raise DaemonStopError(
                    f"daemon pid {self.pid} ignored SIGTERM; SIGKILLed:\n{self.log()}"
                )
        return self.proc.returncode

    def kill(self) -> float:
        """SIGKILL the daemon (a crash) and reap it; returns ``time.monotonic()`` at the kill."""
        self.killed = True
        at = time.monotonic()
        self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)
        return at

    def stop_and_check(self) -> None:
        """:meth:`stop`, then check it exited 0 and left nothing (removing what it left).

        Raises:
            DaemonStopError: it ignored SIGTERM, exited non-zero, or left its socket, its
                lock file or a segment behind.
        """
        rc = self.stop()
        left = self.leftovers()
        for path in left:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if rc != 0 or left:
            raise DaemonStopError(
                f"daemon pid {self.pid} exited {rc}, left behind {left}:\n{self.log()}"
            )


def socket_in(folder: Path, name: str = "d") -> str:
    """The path of socket ``name`` in ``folder``.

    Raises:
        ValueError: the path is too long for a Unix socket (107 bytes).
    """
    path = str(folder / f"{name}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path too long for a Unix socket: {path}")
    return path


@contextlib.contextmanager
def run_daemon(
    models: Sequence[str | os.PathLike[str]] = (),
    *,
    args: Sequence[str] = (),
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = READY_TIMEOUT,
    new_session: bool = False,
) -> Iterator[Daemon]:
    """Start ``weightcache preload MODELS... ARGS...`` on a socket in a fresh temporary
    folder, wait until it is ready with every model READY, and yield it; on exit stop it
    with SIGTERM and check it left nothing, then remove the folder.

    Example::

        with run_daemon([checkpoint_dir]) as daemon:
            weights = weightcache.load(checkpoint_dir, socket=daemon.socket)

    Args:
        models: checkpoint folders or files to preload.
        args: further ``preload`` flags (``--dtype``, ``--device``, ...).
        log_dir: where ``daemon.log`` goes (default: the socket's temporary folder, so the
            log is gone after the block: read it with :meth:`Daemon.log` inside).
        env: variables added to the daemon's environment.
        timeout: seconds it may take to be ready.
        new_session: see :class:`Daemon`.

    Raises:
        DaemonStartError: it exited before ready, was not ready in time, or a model failed
            or was refused (it is stopped first).
        DaemonStopError: at exit, it ignored SIGTERM, exited non-zero or left its socket,
            lock file or a segment.
    """
    folder = short_tempdir()
    try:
        argv = [*(str(m) for m in models), *args]
        daemon = Daemon(
            socket_in(folder),
            argv,
            (log_dir or folder) / "daemon.log",
            env=env,
            new_session=new_session,
        )
        try:
            daemon.wait_ready(timeout, models=len(models))
        except BaseException:
            # Whatever ends the wait (a refusal, Ctrl-C, a timeout), the daemon must not
            # outlive it: with new_session it would not even get the terminal's SIGINT.
            with contextlib.suppress(DaemonStopError):
                daemon.stop_and_check()
            raise
        try:
            yield daemon
        finally:
            daemon.stop_and_check()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class DaemonPool:
    """The daemons of one test; :meth:`close` stops them and checks what they left.

    Args:
        sock_dir: a short folder for sockets (removed by :meth:`close`).
        log_dir: where daemon logs go.
    """

    def __init__(self, sock_dir: Path, log_dir: Path) -> None:
        self.sock_dir = sock_dir
        self.log_dir = log_dir
        self.daemons: list[Daemon] = []

    def socket(self, name: str = "d") -> str:
        """A socket path in the pool's short folder.

        Raises:
            ValueError: the path is too long for a Unix socket.
        """
        return socket_in(self.sock_dir, name)

    def start(
        self,
        models: Sequence[str | os.PathLike[str]] = (),
        *,
        socket: str | None = None,
        dtype: str | None = None,
        args: Sequence[str] = (),
        wait: bool = True,
        wrap: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Daemon:
        """Start ``weightcache preload MODELS... [--dtype DTYPE] ARGS...`` and (by default)
        wait until it is ready; ``wrap`` is a command prefix that ends by exec'ing the
        daemon (same pid). A model that fails does not fail the start: tests of failures
        start such daemons on purpose.

        Raises:
            DaemonStartError: with ``wait``, it exited or was not ready in time.
        """
        argv = [str(m) for m in models]
        if dtype is not None:
            argv += ["--dtype", dtype]
        argv += list(args)
        log_path = self.log_dir / f"daemon-{len(self.daemons)}.log"
        socket = socket or self.socket(f"d{len(self.daemons)}")
        daemon = Daemon(socket, argv, log_path, wrap, env=env)
        self.daemons.append(daemon)
        if wait:
            daemon.wait_ready()
        return daemon

    def clean_after_crash(self, socket: str) -> list[str]:
        """Start and stop a fresh daemon on ``socket``: it must remove the segments a
        SIGKILLed predecessor left. Returns the paths it removed.

        Raises:
            DaemonStartError: the fresh daemon did not start.
            DaemonStopError: it did not stop cleanly or left segments.
            HarnessError: it did not log each removal.
        """
        leftover = shm_segments(segment_tag(socket))
        fresh = self.start((), socket=socket, wait=False)
        try:
            fresh.wait_ready()
        except BaseException:
            fresh.stop()  # close() has already passed its stop loop: stop it here
            raise
        rc = fresh.stop()
        log = fresh.log()
        if rc != 0 or shm_segments(fresh.tag):
            raise DaemonStopError(f"clean-up daemon exited {rc}, left segments:\n{log}")
        for path in leftover:
            if not any(REMOVED_SEGMENT in line and path in line for line in log.splitlines()):
                raise HarnessError(f"{path} was not reported removed:\n{log}")
        return leftover

    def close(self) -> None:
        """Stop every daemon still running, clean up after crashed ones, then check that no
        socket, lock file or segment of any of them remains; removes the socket folder.

        Raises:
            HarnessError: listing everything that was left or went wrong.
        """
        errors: list[str] = []
        try:
            for daemon in reversed(list(self.daemons)):
                try:
                    rc = daemon.stop()
                except HarnessError as exc:
                    errors.append(str(exc))
                    continue
                if rc != 0 and not daemon.killed:
                    errors.append(f"daemon pid {daemon.pid} exited {rc}:\n{daemon.log()}")
            for socket in dict.fromkeys(d.socket for d in self.daemons):
                tag = segment_tag(socket)
                if os.path.lexists(socket) or shm_segments(tag):
                    try:
                        self.clean_after_crash(socket)
                    except HarnessError as exc:
                        errors.append(str(exc))
                for path in (socket, socket + ".lock", *shm_segments(tag)):
                    if os.path.lexists(path):
                        errors.append(f"left behind: {path}")
                        with contextlib.suppress(OSError):
                            os.unlink(path)
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        if errors:
            raise HarnessError("\n".join(errors))


@contextlib.contextmanager
def daemon_pool(log_dir: Path) -> Iterator[DaemonPool]:
    """A :class:`DaemonPool` with a fresh short socket folder, closed (and checked) on exit.

    Raises:
        HarnessError: at exit, as :meth:`DaemonPool.close`.
    """
    pool = DaemonPool(short_tempdir(), log_dir)
    try:
        yield pool
    finally:
        pool.close()
