"""Worker processes driven from a test over pipes (the driving end of the line protocol).

A :class:`Worker` is ``python -m weightcache.testing.worker`` (or another command that
speaks :mod:`weightcache.testing.protocol`) in its own interpreter: a real, separate
process with its own pid, its own KeepAlive stream and its own mappings. Its stderr goes
to a log file; its stdout carries only protocol lines.

Example::

    with worker_pool(tmp_path) as workers:
        reply = workers.start().load(checkpoint_dir, socket=daemon.socket, dump=out)
        assert reply["source"] == "cache", reply["fallback_reason"]
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightcache.testing.daemon import STOP_TIMEOUT, HarnessError, child_env, wait_or_kill
from weightcache.testing.protocol import next_event, next_reply

#: Seconds a worker may take to answer one command (its first one waits for its imports,
#: torch among them: many seconds on a loaded machine).
WORKER_TIMEOUT = 90.0
#: The command line of the worker this package ships.
WORKER_COMMAND = (sys.executable, "-m", "weightcache.testing.worker")


class WorkerDiedError(HarnessError):
    """The worker process ended while the test waited for a message."""


class WorkerTimeoutError(HarnessError):
    """The worker sent nothing within the time the test waited."""


class Worker:
    """A worker process, driven by JSON lines over pipes (see :mod:`weightcache.testing.worker`
    for the commands of the default one).

    Args:
        log_path: the file its stderr goes to (created or truncated).
        command: its command line (default :data:`WORKER_COMMAND`).
        env: variables added to its environment (:func:`weightcache.testing.child_env`).
    """

    def __init__(
        self,
        log_path: Path,
        command: Sequence[str] = WORKER_COMMAND,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                list(command),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(env),
            )
        self._buffer = b""
        self._events: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    def log(self) -> str:
        """Everything the worker wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def send(self, op: str, **fields: Any) -> None:
        """Send one command without waiting for its reply.

        Raises:
            WorkerDiedError: the worker has ended.
        """
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def request(self, op: str, *, timeout: float = WORKER_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """Send a command and return its reply (events that arrive first are kept).

        Raises:
            WorkerDiedError: the worker ended before it replied.
            WorkerTimeoutError: it did not reply within ``timeout`` seconds.
        """
        self.send(op, **fields)
        return self.reply(op, timeout=timeout)

    def reply(self, op: str, *, timeout: float = WORKER_TIMEOUT) -> dict[str, Any]:
        """The reply to a command of kind ``op`` that :meth:`send` sent (events that
        arrive first are kept).

        Raises:
            WorkerDiedError: the worker ended before it replied.
            WorkerTimeoutError: it did not reply within ``timeout`` seconds.
        """
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
        """``weightcache.load(path, **kwargs)`` in the worker, kept there under ``key``.

        Args:
            path: the checkpoint.
            key: the name the result is kept under, for later commands.
            dump: a safetensors file to save the tensors it got to (read it back with
                ``safetensors.torch.load_file`` and compare bitwise).
            lost_callback: pass an ``on_lease_lost`` that sends a ``lease_lost`` event.
            capture_logs: return what it logged (the ``weightcache`` logger, as event dicts:
                :func:`weightcache.testing.logs.capture_sdk_logs`) under ``"logs"``.
            kwargs: JSON-able keyword arguments of ``weightcache.load`` (``socket``, ...).

        Returns:
            ``{"ok": True, "source", "model", "fallback_reason": None or {"code", "detail",
            "components"}, "lease": None or {"ttl", "validity"}, "names",
            "in_shared_memory", "elapsed", "logs"}``, or on a ``WeightCacheError``
            ``{"ok": False, "error": {"type", "detail", "reason", "metadata", ...}}``.

        Raises:
            WorkerDiedError: the worker ended before it replied.
            WorkerTimeoutError: it did not reply within :data:`WORKER_TIMEOUT` seconds.
        """
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
        """The next event called ``name`` the worker sends on its own.

        Raises:
            WorkerDiedError: the worker ended first.
            WorkerTimeoutError: none came within ``timeout`` seconds.
        """
        return next_event(name, timeout, self._read_message, self._events)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeoutError(f"worker pid {self.pid} silent:\n{self.log()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise self._died()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def _died(self) -> WorkerDiedError:
        wait_or_kill(self.proc)  # it may have closed its stdout yet live on
        return WorkerDiedError(
            f"worker pid {self.pid} ended with {self.proc.returncode}:\n{self.log()}"
        )

    def kill(self) -> int:
        """SIGKILL the worker and reap it; returns its exit status."""
        self.proc.kill()
        return self.proc.wait(STOP_TIMEOUT)

    def close(self) -> None:
        """End the worker: EOF on stdin (it releases its leases and exits), SIGKILL if it
        lingers :data:`STOP_TIMEOUT` seconds; close the pipes."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            wait_or_kill(self.proc)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


class WorkerPool:
    """The workers of one test; :meth:`close` ends them all.

    Args:
        log_dir: where worker logs go.
        command: the command line of each worker (default :data:`WORKER_COMMAND`).
        env: variables added to each worker's environment.
    """

    def __init__(
        self,
        log_dir: Path,
        command: Sequence[str] = WORKER_COMMAND,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.command = tuple(command)
        self.env = dict(env or {})
        self.workers: list[Worker] = []

    def start(self, env: Mapping[str, str] | None = None) -> Worker:
        """Start one more worker (it imports in the background; its first reply waits),
        with ``env`` added to the pool's variables."""
        worker = Worker(
            self.log_dir / f"worker-{len(self.workers)}.log",
            self.command,
            {**self.env, **(env or {})},
        )
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        """End every worker (:meth:`Worker.close`), each even when one before it fails.

        Raises:
            Exception: the first failure of a worker's close, after all were tried.
        """
        failures: list[BaseException] = []
        for worker in self.workers:
            try:
                worker.close()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]


@contextlib.contextmanager
def worker_pool(log_dir: Path) -> Iterator[WorkerPool]:
    """A :class:`WorkerPool` of the default worker, its workers ended on exit."""
    pool = WorkerPool(log_dir)
    try:
        yield pool
    finally:
        pool.close()
